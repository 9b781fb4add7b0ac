"""The eviction axis: which cached tokens are dropped for good, when, and how many per head.

An Eviction combines a scorer, an allocator, a budget and a schedule. At each compression the turn
policy names the span of positions that may lose tokens and how many of them the layer keeps; the
scorer ranks them, the allocator splits the count among heads, and the store compacts what stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from turnkv.kv.sequence import SequenceKV
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.protocols import Allocator, Scorer, Turns
from turnkv.methods.window import QueryWindow

SCHEDULES = {
    "prefill": "after each turn's prompt is prefilled; the window is the end of that prompt (question-aware)",
    "prompt": "after each turn's prompt is prefilled, that prompt included but for its window (SnapKV's and "
              "Ada-KV's code on one prompt, as LLM.generate compresses)",
    "context": "after a context is prefilled and before the question that follows it (question-agnostic)",
    "turn_end": "after each reply, before the next message is known (question-agnostic across turns)",
    "decode": "every `every` generated tokens, back to the budget",
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_options(options: dict) -> None:
    """ValueError for the first of budget, keep_ratio, compression_ratio, schedule and every in
    `options` whose value is out of range (a None amount is unset)."""
    budget, keep_ratio, removed = options.get("budget"), options.get("keep_ratio"), options.get("compression_ratio")
    if budget is not None and not (_is_int(budget) and budget >= 1):
        raise ValueError(f"budget must be an integer >= 1 (tokens per KV head), got {budget!r}")
    if keep_ratio is not None and not (_is_number(keep_ratio) and 0 < keep_ratio <= 1):
        raise ValueError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
    if removed is not None and not (_is_number(removed) and 0 <= removed < 1):
        raise ValueError(f"compression_ratio must be a number in [0, 1) (the fraction removed), got {removed!r}")
    if "schedule" in options and options["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {options['schedule']!r}")
    if "every" in options and not (_is_int(options["every"]) and options["every"] >= 1):
        raise ValueError(f"every must be an integer >= 1, got {options['every']!r}")


@dataclass
class Eviction:
    """Evict with `scorer`, split per head by `allocator`, down to `budget` tokens per KV head on
    average (window and sinks included) or to `keep_ratio` of the positions seen, on `schedule`."""

    scorer: Scorer
    allocator: Allocator = field(default_factory=UniformAllocator)
    budget: int | None = None
    keep_ratio: float | None = None
    schedule: str = "prefill"
    every: int = 64

    def __post_init__(self):
        if (self.budget is None) == (self.keep_ratio is None):
            raise ValueError("give exactly one of budget (tokens per KV head) or keep_ratio (fraction kept)")
        check_options({"budget": self.budget, "keep_ratio": self.keep_ratio, "schedule": self.schedule,
                       "every": self.every})

    def target(self, layer: int, num_layers: int, virtual_len: int, available: int) -> int:
        base = self.budget if self.budget is not None else math.floor(self.keep_ratio * virtual_len)
        return self.scorer.layer_target(base, layer, num_layers, available)

    def compress(self, kv: SequenceKV, turns: Turns, lo: int, hi: int, window: QueryWindow | None,
                 inv_freq: torch.Tensor) -> dict:
        """Evict among tokens at positions [lo, hi) in every layer. Returns what was kept, for the log."""
        L, H = kv.lengths.shape
        kept_before = np.zeros((L, H), np.int64)
        budget = np.zeros(L, np.int64)
        for layer in range(L):
            keys, values, pos = kv.gather(layer)
            S = pos.shape[1]
            valid = torch.arange(S, device=pos.device) < torch.from_numpy(kv.lengths[layer]).to(pos.device)[:, None]
            candidate = valid & (pos >= lo) & (pos < hi)
            # One read back per layer of the per-head counts the budget needs.
            kept_before[layer], per_head = torch.stack([((pos < lo) & valid).sum(dim=1),
                                                        candidate.sum(dim=1)]).cpu().numpy()
            n_cand = int(per_head.sum())
            target = self.target(layer, L, hi, int(per_head.max()))
            total = turns.keep_total(H, target, int(kept_before[layer].sum()), n_cand, self.keep_ratio)
            budget[layer] = total
            if total >= n_cand:
                continue
            view = LayerView(
                layer=layer, num_layers=L, keys=keys, values=values, positions=pos, valid=valid,
                queries=window.queries[layer] if window is not None else None,
                query_positions=window.positions[layer] if window is not None else None,
                attention_mass=kv.gather_attention_mass(layer) if self.scorer.accumulates_attention else None,
                inv_freq=inv_freq, next_position=kv.next_position, target=target,
                moments=window.moments.layer(layer) if window is not None and window.moments is not None else None,
            )
            scores = self.scorer.score(view).float().masked_fill(~candidate, float("-inf"))
            if int(torch.isposinf(scores).sum()) > total:
                # More protected tokens than budget: let them compete among themselves, by score order.
                finite_max = scores[torch.isfinite(scores)].max() if torch.isfinite(scores).any() else 0.0
                scores = torch.where(torch.isposinf(scores), finite_max + 1.0 + pos.float() * 1e-6, scores)
            # The allocator reads its per-head counts back once; its work over all S stays on the device.
            counts = self.allocator.allocate(scores, total).to(scores.device)
            order = scores.argsort(dim=1, descending=True, stable=True)
            chosen = torch.zeros_like(candidate)
            chosen.scatter_(1, order, torch.arange(S, device=scores.device)[None] < counts[:, None])
            keep = (valid & ~candidate) | (chosen & candidate)
            kv.keep_mask(layer, keep)
        return {"span": [lo, hi], "budget_per_layer": budget.tolist(), "kept_per_head": kv.lengths.tolist(),
                "kv_bytes": kv.bytes()}
