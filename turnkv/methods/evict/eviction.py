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
import torch.nn.functional as F

from turnkv.kv.sequence import SequenceKV
from turnkv.methods.evict import across_ranks
from turnkv.methods.evict.layer_view import LayerView, stack_layers
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.protocols import Allocator, Scorer, Turns
from turnkv.model.parallel import gather_heads
from turnkv.methods.window import QueryWindow

# Per device type, the (layer x longest head) rows a stacking scorer's group of layers holds at most
# (at least one layer). On a GPU every call costs a launch, so eight 4K-token layers score in one call,
# with no more transient memory than one 32K-token layer alone; on the CPU a call costs little and one
# layer's intermediates stay in cache, so layers score one at a time.
STACK_TOKENS = {"cpu": 0, "cuda": 32768}

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
                 inv_freq: torch.Tensor) -> dict | None:
        """Evict among tokens at positions [lo, hi) in every layer. Returns what was kept, for the log,
        or None when every layer's budget holds all its candidates (nothing was evicted).

        One pass over all layers: one read back of every head's counts gives every layer's budget;
        the layers that lose tokens are scored (a stacking scorer scores groups of them in one call),
        allocated, chosen and compacted together."""
        L, H = kv.lengths.shape
        pos = kv.gather_positions(list(range(L)))  # [L, H, S], S = the longest head of any layer
        S, device = pos.shape[-1], pos.device
        valid = kv.held(list(range(L)), S, device)
        candidate = valid & (pos >= lo) & (pos < hi)
        per_head = torch.stack([((pos < lo) & valid).sum(dim=-1), candidate.sum(dim=-1)])  # [2, L, H]
        shard = kv.pool.shard
        if shard is not None:  # tensor parallel: every rank decides over the whole model's heads
            per_head, H = gather_heads(per_head, shard, dim=2), shard.config.num_kv_heads
        kept_before, per_head = per_head.cpu().numpy()
        budget, targets, todo = np.zeros(L, np.int64), {}, []
        for layer in range(L):
            n_cand = int(per_head[layer].sum())
            targets[layer] = self.target(layer, L, hi, int(per_head[layer].max()))
            budget[layer] = turns.keep_total(H, targets[layer], int(kept_before[layer].sum()), n_cand, self.keep_ratio)
            if budget[layer] < n_cand:
                todo.append(layer)
        if not todo:
            return None
        rows = torch.tensor(todo).to(device)
        candidate = candidate[rows]
        scores = self._scores(kv, todo, targets, window, inv_freq, S).masked_fill(~candidate, float("-inf"))
        totals = torch.from_numpy(budget[todo]).to(device)
        if shard is None:
            scores = _rank_surplus_protected(scores, pos[rows], totals)
            # The allocator reads its per-head counts back once; its work over all S stays on the device.
            counts = self.allocator.allocate_layers(scores, budget[todo].tolist()).to(device)  # [T, H]
        else:
            whole, whole_pos = across_ranks.gathered_scores(scores, pos[rows], shard)
            whole = _rank_surplus_protected(whole, whole_pos, totals)
            counts = self.allocator.allocate_layers(whole, budget[todo].tolist()).to(device)
            counts, scores = across_ranks.own_heads(counts, shard), across_ranks.own_heads(whole, shard, S)
        order = scores.argsort(dim=-1, descending=True, stable=True)
        chosen = torch.zeros_like(candidate)
        chosen.scatter_(-1, order, torch.arange(S, device=device) < counts[..., None])
        # Every rank compacts the same layers here: copies of shared pages take room agreed across ranks.
        kv.keep_masks(todo, (valid[rows] & ~candidate) | (chosen & candidate), lockstep=True)
        return {"span": [lo, hi], "budget_per_layer": budget.tolist(), "kept_per_head": kv.lengths.tolist(),
                "kv_bytes": kv.bytes()}

    def _scores(self, kv: SequenceKV, layers: list[int], targets: dict[int, int], window: QueryWindow | None,
                inv_freq: torch.Tensor, S: int) -> torch.Tensor:
        """[len(layers), H, S] float scores of `layers`, padded with -inf past each one's longest head: a
        stacking scorer scores groups of layers in one call (STACK_TOKENS), any other one layer at a time.
        Each group's gathered K/V is dropped once it is scored, so the transient memory is one group's."""
        H, scores = kv.pool.num_kv_heads, []
        for group in self._groups(kv, layers, window):
            view = self._view(kv, group, targets, window, inv_freq)
            x = self.scorer.score(view).float().reshape(-1, H, view.keys.shape[1])
            scores.append(F.pad(x, (0, S - x.shape[-1]), value=float("-inf")))
            del view, x
        return torch.cat(scores)

    def _view(self, kv: SequenceKV, group: list[int], targets: dict[int, int], window: QueryWindow | None,
              inv_freq: torch.Tensor) -> LayerView:
        """The scorer's view of one layer, or of a group of layers stacked as rows."""
        if len(group) > 1:
            keys, values, pos = kv.gather_layers(group)
            return stack_layers(group, keys, values, pos, kv, window, inv_freq)
        layer = group[0]
        keys, values, pos = kv.gather(layer)
        return LayerView(
            layer=layer, num_layers=kv.pool.num_layers, keys=keys, values=values, positions=pos,
            valid=kv.held([layer], pos.shape[1], pos.device)[0],
            queries=window.queries[layer] if window is not None else None,
            query_positions=window.positions[layer] if window is not None else None,
            attention_mass=kv.gather_attention_mass(layer) if self.scorer.accumulates_attention else None,
            inv_freq=inv_freq, next_position=kv.next_position, target=targets[layer],
            moments=window.moments.layer(layer) if window is not None and window.moments is not None else None,
            shard=kv.pool.shard,
        )

    def _groups(self, kv: SequenceKV, layers: list[int], window: QueryWindow | None) -> list[list[int]]:
        """Consecutive runs of `layers`, each holding at most STACK_TOKENS (layer x longest head) rows
        when the scorer stacks layers (and every layer's window has one shape), else one layer each."""
        shapes = {None if window is None or window.positions[layer] is None else tuple(window.positions[layer].shape)
                  for layer in layers}
        stacks = self.scorer.stacks_layers and len(shapes) == 1
        limit = STACK_TOKENS.get(kv.pool.device.type, STACK_TOKENS["cuda"])
        groups, rows = [], limit
        for layer in layers:
            longest = int(kv.lengths[layer].max(initial=0))
            if not stacks or rows + longest > limit:
                groups.append([])
                rows = 0
            groups[-1].append(layer)
            rows += longest
        return groups


def _rank_surplus_protected(scores: torch.Tensor, pos: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Where a layer has more protected (+inf) tokens than its total [T], they compete among themselves:
    each scores just above the layer's best finite score, later positions first. scores, pos [T, H, S]."""
    protected = torch.isposinf(scores)
    surplus = protected.sum(dim=(1, 2)) > totals  # [T]
    best = scores.masked_fill(~torch.isfinite(scores), float("-inf")).amax(dim=(1, 2))
    best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))[:, None, None]
    return torch.where(surplus[:, None, None] & protected, best + 1.0 + pos.float() * 1e-6, scores)
