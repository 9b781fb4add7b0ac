"""The interfaces of the eviction axis: what a scorer sees of one layer, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.attention.reference import attention_weights


@dataclass
class LayerView:
    """One layer of one conversation's KV, as a scorer sees it.

    keys/values: [H, S, D] post-RoPE, padded to the longest head; valid: [H, S] marks real entries.
    positions: [H, S] original positions. queries: [W, Hq, D] the observation window (post-RoPE), at
    query_positions [W]. attention_mass: [H, S] what each token has received so far (H2O).
    target: the per-head token count this layer will keep (for scorers that split it, e.g. H2O).
    """

    layer: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor | None
    query_positions: torch.Tensor | None
    attention_mass: torch.Tensor | None
    inv_freq: torch.Tensor
    next_position: int
    target: int

    def window_attention(self) -> torch.Tensor:
        """Softmax weights [Hq, W, S] of the window's queries over every key they could see (fp32)."""
        if self.queries is None:
            raise ValueError("this scorer needs an observation window, and none was recorded")
        mask = self.valid[:, None, :] & (self.positions[:, None, :] <= self.query_positions[None, :, None])
        q = self.queries.transpose(0, 1)[None]  # [1, Hq, W, D]
        return attention_weights(q, self.keys[None], mask[None])[0]

    def group_mean(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """[Hq, ...] -> [H, ...]: average over the query heads that share a KV head (GQA)."""
        H = self.keys.shape[0]
        return per_query_head.view(H, -1, *per_query_head.shape[1:]).mean(dim=1)


class Scorer:
    """Scores every held token of a layer; higher is more worth keeping. +inf marks a token that must
    stay (a sink, the observation window); the driver picks each head's top tokens among the candidates."""

    window: int = 0  # queries the scorer needs recorded
    accumulates_attention: bool = False

    def score(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError

    def layer_target(self, target: int, layer: int, num_layers: int, available: int) -> int:
        """The per-head token target of `layer` given the average target (PyramidKV overrides this)."""
        return target


class Allocator:
    """Splits a layer's token budget among its KV heads."""

    def allocate(self, scores: torch.Tensor, total: int) -> torch.Tensor:
        """scores [H, S] (+inf protected, -inf not a candidate) -> kept counts [H] summing to total."""
        raise NotImplementedError


def protected_and_capacity(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: tokens that must stay (+inf) and tokens free to compete (finite)."""
    return torch.isposinf(scores).sum(dim=1), torch.isfinite(scores).sum(dim=1)


def fit_counts(desired: torch.Tensor, capacity: torch.Tensor, total: int) -> torch.Tensor:
    """Integer counts <= capacity, summing to min(total, capacity.sum()), close to `desired` (float):
    floors first, then the largest remainders, then any shortfall to heads that still have room."""
    total = min(int(total), int(capacity.sum()))
    desired = desired.double().clamp(min=0)
    counts = torch.minimum(desired.floor().long(), capacity)
    left = total - int(counts.sum())
    if left > 0:
        order = (desired - desired.floor()).argsort(descending=True)
        for i in order.tolist():
            if left == 0:
                break
            if counts[i] < capacity[i]:
                counts[i] += 1
                left -= 1
    while left > 0:  # heads at capacity pass their share to the heads that still have room
        room = capacity - counts
        open_heads = (room > 0).nonzero().flatten().tolist()
        share = -(-left // len(open_heads))
        for i in open_heads:
            give = min(int(room[i]), share, left)
            counts[i] += give
            left -= give
    while left < 0:  # floors above the total (tiny budgets): take back from the largest
        i = int(counts.argmax())
        counts[i] -= 1
        left += 1
    return counts
