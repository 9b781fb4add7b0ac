"""Krul: per-conversation cross-layer sharing of the stored KV and a bubble-free recompute/load
restore; and its baselines MiniCache (fixed latter-half pairs) and Krul (Fix).

At turn end Krul scores each layer's I-R pattern from the turn's recomputed attention rows
(estimator.py), pairs I-R layers greedily by attention distance, picks a non-increasing pyramid of
per-layer recompute lengths from the machine's calibrated costs (schedule.py), and stores the loaded
part with each pair merged (split.py, merge.py). Restore recomputes the prefixes on the current
stream while the side stream loads. Design: docs/methods/krul.md"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from turnkv.kv.snapshot import layout_of
from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import register
from turnkv.state import pairing, schedule
from turnkv.state.base import Stored
from turnkv.state.estimator import TurnQueries, attention_statistics
from turnkv.state.load import LoadStrategy
from turnkv.state.recompute import RecomputeStrategy
from turnkv.state.split import pack_split, restore_split

# The baselines Krul stores a conversation by when its plan predicts no gain over them.
FALLBACKS = {"load": LoadStrategy, "recompute": RecomputeStrategy}


@dataclass
class SharedLayers(StateStrategy):
    """What Krul and its baselines share: pairs are merged, the rest is split recompute/load."""

    layer_ratio: float = 0.5
    recompute_ratio: float | None = None
    allocation: str = "budget"
    tau: float = 0.6
    retain_threshold: float = 0.05
    max_retained: float = 0.05
    storage: float | None = None
    needs_costs: ClassVar[bool] = True

    def __post_init__(self):
        if not 0 <= self.layer_ratio <= 1:
            raise ValueError("layer_ratio must be in [0, 1]")
        if self.recompute_ratio is not None and not 0 <= self.recompute_ratio <= 1:
            raise ValueError("recompute_ratio must be in [0, 1]")
        if self.allocation not in ("budget", "min_storage"):
            raise ValueError("allocation is budget or min_storage")
        if not 0 <= self.max_retained <= 1:
            raise ValueError("max_retained must be in [0, 1]")
        if self.storage is not None and not 0 <= self.storage <= 1:
            raise ValueError("storage must be in [0, 1] (a share of the full KV)")

    def pairs(self, ctx, seq, window, clock) -> tuple[list[tuple[int, int]], dict]:
        raise NotImplementedError

    def fallback_for(self, ctx, seq, starts, pairs, tier, prepared: dict | None = None
                     ) -> tuple[StateStrategy, dict] | None:
        """A baseline to store the conversation by instead of the split plan, with the predictions
        that chose it (prepared: what prepare() returned); None keeps the plan (default: always)."""
        return None

    def prepare(self, ctx, seq, window, tier: str = "cpu") -> dict:
        """{"pairs", "info", "timing"}: the layer pairs (Krul's estimator sums every rank's query
        heads: a collective under tensor parallelism), what chose them, and the seconds it took."""
        timing = {}
        pairs, info = self.pairs(ctx, seq, window, _Clock(seq.pool.device, timing))
        return {"pairs": pairs, "info": info, "timing": timing}

    def pack(self, ctx, seq, window, tier="cpu", prepared=None) -> Stored:
        c = ctx.config
        prepared = self.prepare(ctx, seq, window, tier) if prepared is None else prepared
        timing = dict(prepared["timing"])
        pairs, info = prepared["pairs"], prepared["info"]
        if "fallback" in prepared:  # decided before any pairing (KrulStrategy.prepare)
            baseline, predicted = prepared["fallback"]
            stored = baseline.pack(ctx, seq, window, tier)
            return Stored({**stored.meta, **info, "fallback": baseline.name, "predicted_s": predicted,
                           "pack_timing": timing}, stored.tensors)
        clock = _Clock(seq.pool.device, timing)
        n = seq.next_position
        ratio = self.recompute_ratio if self.recompute_ratio is not None else ctx.recompute_ratio(n, tier)
        if ratio == 0 and self.allocation == "min_storage" and self.storage is None:
            starts = [0] * c.num_layers
        else:
            starts = schedule.pyramid(n, c.num_layers, pairs, ctx.cost(tier), ratio, c.num_kv_heads, c.head_dim,
                                      ctx.element_size, self.allocation, retained_share=self.max_retained,
                                      storage=self.storage)
        clock.lap("schedule_s")
        fallback = self.fallback_for(ctx, seq, starts, pairs, tier, prepared)
        if fallback is not None:
            baseline, predicted = fallback
            stored = baseline.pack(ctx, seq, window, tier)
            return Stored({**stored.meta, **info, "fallback": baseline.name, "predicted_s": predicted,
                           "planned_starts": [int(x) for x in starts], "pack_timing": timing}, stored.tensors)
        meta, tensors = pack_split(seq, starts, pairs, self.tau, self.retain_threshold, self.max_retained, clock,
                                   on_host=ctx.stage_on_host)
        full = schedule.full_bytes(n, c.num_layers, c.num_kv_heads, c.head_dim, ctx.element_size)
        stored = Stored(meta, tensors).nbytes
        return Stored({**meta, **info, "recompute_ratio": ratio,
                       "recompute_share": sum(starts) / max(1, n * c.num_layers),
                       "stored_bytes": stored, "full_bytes": full, "pack_timing": timing}, tensors)

    def restore(self, ctx, seq, tokens, meta, tensors):
        if "fallback" in meta:
            return FALLBACKS[meta["fallback"]]().restore(ctx, seq, tokens, meta, tensors)
        return restore_split(ctx, seq, tokens, meta, tensors)


@register("state", "krul")
@dataclass
class KrulStrategy(SharedLayers):
    """Krul: I-R layers paired per conversation by attention similarity, merged MiniCache-style, and
    a pyramid recompute/load split calibrated to leave no bubble.

    Parameters (defaults and meaning: docs/methods/krul.md#parameters-and-defaults): ir_threshold (gamma),
    region_share, layer_ratio (r_l), recompute_ratio (r_c, None: calibrated), allocation, storage,
    estimator, estimator_rows, estimator_seed, tau, retain_threshold, max_retained, fallback, overhead,
    overhead_s. With fallback="auto" a conversation the plan would not speed up is stored by `load` or
    `recompute`; the stored meta then names it ("fallback") with the predictions ("predicted_s")."""

    ir_threshold: float = 0.3
    region_share: float = 0.1
    estimator: str = "auto"
    estimator_rows: int | None = 512
    estimator_seed: int = 0
    fallback: str = "auto"
    overhead: float = 1.4
    overhead_s: float = 0.025

    def __post_init__(self):
        super().__post_init__()
        if self.estimator not in ("auto", "device", "cpu"):
            raise ValueError("estimator is auto, device or cpu")
        if self.estimator_rows is not None and self.estimator_rows < 1:
            raise ValueError("estimator_rows must be positive (or None: exact)")
        if self.fallback not in ("auto", "never"):
            raise ValueError("fallback is auto or never")
        if self.overhead < 1 or self.overhead_s < 0:
            raise ValueError("overhead must be >= 1 and overhead_s >= 0")

    def prepare(self, ctx, seq, window, tier: str = "cpu") -> dict:
        """Also "recomputable" with fallback="auto": whether a prefill rebuilds the state of every
        rank's heads (under tensor parallelism agreed by a collective, so that every rank stores its
        shard by the same baseline). And "fallback" (baseline, predictions) when no pairing could make
        the plan win (hopeless): the estimator does not run, the turn's queries are dropped."""
        if self.fallback == "never":
            return super().prepare(ctx, seq, window, tier)
        start = time.perf_counter()
        recomputable = layout_of(seq).meta()["recomputable"]
        if seq.pool.agree is not None:
            recomputable = seq.pool.agree([int(not recomputable)])[0] == 0
        hopeless = self.hopeless(ctx, seq, tier, recomputable)
        if hopeless is None:
            return {**super().prepare(ctx, seq, window, tier), "recomputable": recomputable}
        if isinstance(window, TurnQueries):
            window.take()
        return {"pairs": [], "info": {"selection": "skipped"}, "timing": {"bound_s": time.perf_counter() - start},
                "recomputable": recomputable, "fallback": hopeless}

    def baselines(self, ctx, seq, tier, recomputable: bool) -> dict:
        """Predicted restore seconds of the baselines Krul may fall back to: `load` (unless a storage
        share caps what is stored) and `recompute` (where a prefill rebuilds the same state)."""
        c, cost, n = ctx.config, ctx.cost(tier), seq.next_position
        predicted = {}
        if self.storage is None or self.storage >= 1:
            full = schedule.full_bytes(n, c.num_layers, c.num_kv_heads, c.head_dim, ctx.element_size)
            predicted["load"] = float(cost.load_s(full))
        if recomputable:
            predicted["recompute"] = float(cost.compute_s(np.full(c.num_layers, n)))
        return predicted

    def hopeless(self, ctx, seq, tier, recomputable: bool) -> tuple[StateStrategy, dict] | None:
        """(baseline, predictions) when even the plan's best case, whatever the estimator pairs, is
        predicted slower than a baseline; the best case is overhead x schedule.best_case_s (the
        stored bytes at their floor over every pairing of at most schedule.max_pairs pairs, the
        budget disregarded) + overhead_s, never above what fallback_for predicts for any pairing.
        None where the plan may win: the estimator decides (fallback_for)."""
        c, n = ctx.config, seq.next_position
        predicted = self.baselines(ctx, seq, tier, recomputable)
        if not predicted:
            return None
        ratio = self.recompute_ratio if self.recompute_ratio is not None else ctx.recompute_ratio(n, tier)
        best = schedule.best_case_s(n, c.num_layers, schedule.max_pairs(c.num_layers, self.layer_ratio),
                                    ctx.cost(tier), ratio, c.num_kv_heads, c.head_dim, ctx.element_size,
                                    self.max_retained)
        krul = self.overhead * best + self.overhead_s
        baseline = min(predicted, key=predicted.get)
        if krul <= predicted[baseline]:
            return None
        return FALLBACKS[baseline](), {"krul": krul, **predicted}

    def fallback_for(self, ctx, seq, starts, pairs, tier, prepared=None):
        """`load` or `recompute` when the plan's predicted restore, its streams' contention and fixed
        cost counted (overhead x max(T_C, T_L) + overhead_s), is no faster than theirs; recompute only
        where a prefill rebuilds the same state (nothing evicted)."""
        if self.fallback == "never":
            return None
        c, cost, n = ctx.config, ctx.cost(tier), seq.next_position
        stored = schedule.stored_bytes(starts, n, pairs, c.num_kv_heads, c.head_dim, ctx.element_size,
                                       self.max_retained)
        plan = max(float(cost.compute_s(starts)), float(cost.load_s(stored)))
        prepared = prepared or {}
        recomputable = prepared["recomputable"] if "recomputable" in prepared else layout_of(seq).meta()["recomputable"]
        predicted = {"krul": self.overhead * plan + self.overhead_s, **self.baselines(ctx, seq, tier, recomputable)}
        best = min(predicted, key=predicted.get)
        if best == "krul":
            return None
        return FALLBACKS[best](), predicted

    path_independent = False  # TurnQueries: the whole turn's queries choose the pairs

    def query_window(self, num_layers, size):
        return TurnQueries(num_layers, size)

    def pairs(self, ctx, seq, window, clock):
        queries, positions, is_decode = window.take() if isinstance(window, TurnQueries) else ([None], None, None)
        if queries[0] is None or not len(positions):
            # Nothing recorded since the last store (e.g. a demotion right after a restore): keep
            # the pairs chosen last time for this conversation.
            last = getattr(window, "last_pairs", [])
            return last, {"selection": "previous"}
        ir, distance = attention_statistics(seq, queries, positions, is_decode, self.region_share, self.estimator,
                                            self.estimator_rows, self.estimator_seed)
        clock.lap("estimator_s")
        pairs = pairing.select_pairs(ir, distance, self.ir_threshold, self.layer_ratio)
        clock.lap("pairing_s")
        window.last_pairs = pairs
        return pairs, {"ir_score": [round(float(x), 4) for x in ir], "selection": "estimated",
                       "estimator_rows": [min(len(positions), self.estimator_rows or len(positions)), len(positions)]}


@register("state", "minicache")
@dataclass
class MiniCacheStrategy(SharedLayers):
    """MiniCache as a restoration baseline (FKC): adjacent pairs of the latter half merged for every
    conversation, everything loaded (recompute_ratio 0, no pyramid)."""

    recompute_ratio: float | None = 0.0
    allocation: str = "min_storage"

    def pairs(self, ctx, seq, window, clock):
        return pairing.minicache_pairs(ctx.config.num_layers, self.layer_ratio), {"selection": "fixed"}


@register("state", "krul_fix")
@dataclass
class KrulFixStrategy(SharedLayers):
    """Krul (Fix): fixed adjacent pairs in layers 9-24 (of 32, scaled to the depth) with Krul's
    calibrated pyramid restore."""

    def pairs(self, ctx, seq, window, clock):
        return pairing.krul_fix_pairs(ctx.config.num_layers, self.layer_ratio), {"selection": "fixed"}


class _Clock:
    """Wall time of a pack's phases into `timing` (seconds); synchronises the current stream at each
    lap so the phases do not blur (a pack ends in a device->host copy anyway). Only that stream: a
    pack on a background thread's stream does not wait for the engine's steps."""

    def __init__(self, device: torch.device, timing: dict):
        self.device, self.timing, self.t = device, timing, time.perf_counter()
        self.cuda = device.type == "cuda"

    def lap(self, key: str) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.timing[key] = self.timing.get(key, 0.0) + now - self.t
        self.t = now
