"""MInference-style static vertical-slash prefill: per head, a fixed number of vertical and slash
lines, chosen from the attention of the chunk's last queries (the LoopServe paper's baseline).

Unlike LoopServe's greedy, the budgets do not adapt to how concentrated a head is. One budget serves
every head here: MInference's official per-head patterns come from an offline search per model,
which turnkv does not ship."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.attention import lines
from turnkv.methods.prefill.pattern_hook import clock, since, with_times
from turnkv.methods.protocols import Prefill
from turnkv.methods.registry import register


@register("prefill", "minference")
@dataclass
class MInferencePrefill(Prefill):
    """MInference vertical-slash: top-`vertical` columns + top-`slash` diagonals per query head.

    last: the chunk's last queries that estimate the pattern (64). force_sink: key positions below it
    are always vertical lines; force_local: offsets below it always slash lines (the nearest
    diagonals, which also keep every row non-empty)."""

    vertical: int = 1000
    slash: int = 6096
    last: int = 64
    force_sink: int = 30
    force_local: int = 100

    def __post_init__(self):
        if self.vertical < 0 or self.slash < 1 or self.last < 1 or self.force_sink < 0 or self.force_local < 1:
            raise ValueError("vertical and force_sink must be >= 0; slash, last and force_local >= 1")

    def attend(self, layer: int, keys: lines.Keys):
        device = keys.q.device
        t0 = clock(device)
        B, Hq, T, _ = keys.q.shape
        G = keys.group
        rows = torch.arange(max(0, T - self.last), T, device=device)
        weights = lines.sample_weights(keys, rows).reshape(B * Hq, len(rows), -1)
        offsets = lines.per_unit(keys.offsets(rows), G, True)
        w_v, _, w_s, _ = lines.line_sums(weights, offsets, keys.end_position)
        k_pos = lines.per_unit(keys.k_pos, G, True)
        if keys.valid is not None:
            w_v = w_v.masked_fill(~lines.per_unit(keys.valid, G, True), float("-inf"))
        w_v = w_v.masked_fill(k_pos < self.force_sink, float("inf"))
        w_s[:, : self.force_local] = float("inf")
        vertical = torch.zeros_like(w_v, dtype=torch.bool)
        vertical.scatter_(1, w_v.topk(min(self.vertical, w_v.shape[1]), dim=1).indices, True)
        if keys.valid is not None:
            vertical &= lines.per_unit(keys.valid, G, True)
        slash = torch.zeros_like(w_s, dtype=torch.bool)
        slash.scatter_(1, w_s.topk(min(self.slash, w_s.shape[1]), dim=1).indices, True)
        search = since(t0, device)
        t1 = clock(device)
        out, computed, causal = lines.line_attention(keys, vertical, slash, True)
        return out, with_times(dict(layer=layer, computed=computed, causal=causal, vertical=vertical.sum(dim=1).view(B, Hq),
                                slash=slash.sum(dim=1).view(B, Hq)),
                           time_search=search, time_sparse_attention=since(t1, device))
