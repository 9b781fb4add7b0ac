"""Recompute the front of the history and load the back, in parallel (the PRE baseline: Pensieve,
Cake); the split is the same in every layer and calibrated on this machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import register
from turnkv.state.base import Stored
from turnkv.state.split import pack_split, restore_split


@register("state", "partial")
@dataclass
class PartialStrategy(StateStrategy):
    """Every layer recomputes the first r_c of the history and loads the rest.

    recompute_ratio : float or None, default None
        r_c; None calibrates it (min max(T_recompute, T_load) for this history length and tier)."""

    recompute_ratio: float | None = None
    needs_costs: ClassVar[bool] = True

    def __post_init__(self):
        if self.recompute_ratio is not None and not 0 <= self.recompute_ratio <= 1:
            raise ValueError("recompute_ratio must be in [0, 1]")

    def pack(self, ctx, seq, window, tier="cpu", prepared=None) -> Stored:
        n = seq.next_position
        ratio = self.recompute_ratio if self.recompute_ratio is not None else ctx.recompute_ratio(n, tier)
        meta, tensors = pack_split(seq, [int(round(ratio * n))] * seq.pool.num_layers, on_host=ctx.stage_on_host)
        return Stored({**meta, "recompute_ratio": ratio}, tensors)

    def restore(self, ctx, seq, tokens, meta, tensors):
        return restore_split(ctx, seq, tokens, meta, tensors)
