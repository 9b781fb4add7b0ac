"""What a scorer sees of one layer of one conversation (Scorer.score in turnkv.methods.protocols)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.attention.reference import attention_weights
from turnkv.model.parallel import Shard


@dataclass
class LayerView:
    """One layer of one conversation's KV, as a scorer sees it.

    keys/values: [H, S, D] post-RoPE, padded to the longest head; valid: [H, S] marks real entries.
    positions: [H, S] original positions. queries: [W, Hq, D] the observation window (post-RoPE), at
    query_positions [W]. attention_mass: [H, S] what each token has received so far (H2O).
    target: the per-head token count this layer will keep (for scorers that split it, e.g. H2O).
    moments: (count [], sum [Hq, D], sum of outer products [Hq, D, D]) of every pre-RoPE query the
    conversation computed at positions >= Scorer.query_moments (float64), or None.
    shard: under tensor parallelism, the model's part whose KV heads the view holds (a scorer that
    reads across all heads of the layer gathers from the other ranks, methods/evict/across_ranks.py);
    None on one device, and in a view of stacked layers.
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
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    shard: Shard | None = None

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


def stack_layers(layers: list[int], keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, kv,
                 window, inv_freq: torch.Tensor) -> LayerView:
    """One view of several layers (SequenceKV.gather_layers: keys, values [G, H, S, D], positions
    [G, H, S]) whose rows are every layer's KV heads, layer-major: [G*H, ...], with the window's
    queries [W, G*Hq, D]. For scorers that score each row on its own (Scorer.stacks_layers): it
    holds no attention mass nor moments, and its layer is the first one and its target 0."""
    G, H, S = positions.shape
    queries = None if window is None else [window.queries[layer] for layer in layers]
    return LayerView(
        layer=layers[0], num_layers=kv.pool.num_layers, keys=keys.flatten(0, 1), values=values.flatten(0, 1),
        positions=positions.flatten(0, 1),
        valid=kv.held(layers, S, positions.device).flatten(0, 1),
        queries=None if queries is None or queries[0] is None else torch.cat(queries, dim=1),
        query_positions=None if window is None else window.positions[layers[0]],
        attention_mass=None, inv_freq=inv_freq, next_position=kv.next_position, target=0)
