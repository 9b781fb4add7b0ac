"""LoopServe's decode axis: progressive KV selection (Algorithm 6, spec loopserve.md §3.3).

Per turn: the first `warmup` decode steps read the full KV. At decode step n_o = warmup, and every
`interval` steps after it, each head keeps the top-`budget` of its kept tokens, scored by the summed
softmax attention (over all kept keys) of the last `window` queries; tokens that arrive after a
re-selection are read too until the next one. Nothing is evicted: the full KV stays in the store
because a re-selection may pick any token. The decode step reads the selection through the indexed
decode kernel (engine/selection.py).

Counting: decode step n feeds the n-th generated token, so at n_o = 16 the window of 16 holds the
queries of exactly the 16 generated tokens (the current one included), as §3.3.3 reads the listing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention import reference
from turnkv.methods.registry import register


@register("decode", "loopserve")
@dataclass
class LoopServeDecode:
    """LoopServe progressive decode: per-head top-B re-selected every n_d steps (Alg. 6).

    budget: tokens each head keeps from the history (B, 1024). interval: n_d, steps between
    re-selections (16). warmup: decode steps on the full KV before the first selection (16).
    window: observation queries that score the tokens (None: interval). granularity: "query" (one
    selection per query head) or "kv" (per KV head, the group's scores summed: one read serves the
    group). sinks: positions below it are always kept (0: the paper forces none)."""

    budget: int = 1024
    interval: int = 16
    warmup: int = 16
    window: int | None = None
    granularity: str = "query"
    sinks: int = 0

    def __post_init__(self):
        if self.granularity not in ("query", "kv"):
            raise ValueError(f"granularity must be query or kv, not {self.granularity!r}")
        if self.budget < 1 or self.interval < 1 or self.warmup < 0 or self.sinks < 0:
            raise ValueError("budget and interval must be >= 1, warmup and sinks >= 0")
        if self.window is not None and self.window < 1:
            raise ValueError("window must be >= 1 or None")

    @property
    def observation(self) -> int:
        return self.window if self.window is not None else self.interval

    def new_state(self, num_layers: int) -> ProgressiveSelection:
        return ProgressiveSelection(self, num_layers)


@dataclass
class _Picked:
    """One layer's selection: entries [R, K] (ascending, the first counts[r] valid), and per row the
    entry from which every token is read (the tokens since the selection)."""

    entries: torch.Tensor
    counts: np.ndarray
    recent_from: np.ndarray  # [R]
    step: int


class ProgressiveSelection:
    """One conversation's selection state; the engine calls begin() once per forward step, observe()
    per layer with the step's queries, and entries() per layer of a decode step."""

    def __init__(self, config: LoopServeDecode, num_layers: int):
        self.config = config
        self.queries: list[torch.Tensor | None] = [None] * num_layers  # [W, Hq, D], post-RoPE
        self.positions: list[torch.Tensor | None] = [None] * num_layers
        self.picked: list[_Picked | None] = [None] * num_layers
        self.steps = 0  # decode steps in this turn
        self.reselect = False
        self.selections = 0  # re-selections in this turn (counted in layer 0)

    def begin(self, decoding: bool) -> None:
        if not decoding:  # a prefill: a new turn starts from warm-up (§3.4: selections are per turn)
            self.steps, self.reselect, self.selections = 0, False, 0
            self.picked = [None] * len(self.picked)
            return
        self.steps += 1
        w, n = self.config.warmup, self.config.interval
        self.reselect = self.steps == w or (self.steps > w and (self.steps - w) % n == 0)

    def observe(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """q [T, Hq, D] of this step; keeps the last `window` of them (the prompt's tail included)."""
        size = self.config.observation
        if self.queries[layer] is not None and q.shape[0] < size:
            q = torch.cat([self.queries[layer], q])
            positions = torch.cat([self.positions[layer], positions])
        self.queries[layer] = q[-size:].detach().clone()
        self.positions[layer] = positions[-size:].clone()

    def entries(self, layer: int, seq):
        """What this decode step reads in `layer` (see engine/selection.py), or None in warm-up."""
        if self.steps < self.config.warmup:
            return None
        lengths = seq.lengths[layer]  # [H], the current token included
        picked = self.picked[layer]
        # Tokens evicted since the selection (an eviction axis in the same recipe) shift entries:
        # then the old selection no longer names the right tokens and is made again.
        stale = picked is None or not np.array_equal(
            picked.recent_from[:: picked.recent_from.shape[0] // len(lengths)] + (self.steps - picked.step) + 1, lengths)
        if self.reselect or stale:
            picked = self.picked[layer] = self._select(layer, seq)
            if layer == 0:
                self.selections += 1
        rows = picked.entries.shape[0]
        recent_from = picked.recent_from
        total = np.repeat(lengths, rows // len(lengths))
        counts = picked.counts + (total - recent_from)
        width = int(counts.max())
        idx = torch.arange(width, device=picked.entries.device)[None]
        chosen = torch.from_numpy(picked.counts).to(idx.device)[:, None]
        start = torch.from_numpy(recent_from).to(idx.device)[:, None]
        if picked.entries.shape[1]:
            old = picked.entries.gather(1, idx.clamp_max(picked.entries.shape[1] - 1).expand(rows, -1))
        else:
            old = torch.zeros_like(idx).expand(rows, -1)
        return torch.where(idx < chosen, old, start + idx - chosen), counts

    def _select(self, layer: int, seq) -> _Picked:
        """Alg. 6 line 5: per row, the top-budget history tokens by the window's summed attention."""
        cfg = self.config
        k, _, k_pos = seq.gather(layer)  # [H, S, D], [H, S]
        H, S = k_pos.shape
        lengths = seq.lengths[layer]
        q, q_pos = self.queries[layer], self.positions[layer]  # [W, Hq, D], [W]
        Hq = q.shape[1]
        valid = torch.arange(S, device=k.device) < torch.from_numpy(lengths).to(k.device)[:, None]
        mask = valid[:, None, :] & (k_pos[:, None, :] <= q_pos[None, :, None])  # [H, W, S]
        scores = reference.attention_weights(q.transpose(0, 1)[None], k[None], mask[None])[0].sum(dim=1)  # [Hq, S]
        rows = Hq if cfg.granularity == "query" else H
        if rows == H and Hq != H:
            scores = scores.view(H, Hq // H, S).sum(dim=1)
        group = rows // H
        # History = everything before the current token, which is read as a recent token.
        recent_from = np.repeat(lengths - 1, group)
        history = torch.arange(S, device=k.device)[None] < torch.from_numpy(recent_from).to(k.device)[:, None]
        scores = scores.masked_fill(~history, float("-inf"))
        if cfg.sinks:
            sink = k_pos.repeat_interleave(group, dim=0) < cfg.sinks
            scores = scores.masked_fill(history & sink, float("inf"))
        kept = min(cfg.budget, int(recent_from.max()))
        top = scores.topk(kept, dim=1).indices
        counts = np.minimum(recent_from, cfg.budget)
        # Rows with fewer history tokens than `kept` picked padding last; push it past the valid ones.
        top = torch.where(history.gather(1, top), top, S).sort(dim=1).values
        return _Picked(top, counts, recent_from, self.steps)
