"""The multi-turn baseline: every compression re-scores the whole carried cache.

Early turns are compressed again and again (the FlowKV paper's eq. 9). Two budget readings:
"matched" keeps the recipe's target over everything kept so far (the paper's fairness claim), and
"naive" keeps the target ratio of whatever the cache holds now (kvpress applied turn after turn), so
the cache shrinks geometrically.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.protocols import Turns
from turnkv.methods.registry import register


@register("turns", "recompress")
@dataclass
class RecompressTurns(Turns):
    """Re-score and re-compress the whole carried cache at every compression (the baseline)."""

    budget_rule: str = "matched"

    def __post_init__(self):
        if self.budget_rule not in ("matched", "naive"):
            raise ValueError("budget_rule must be 'matched' or 'naive'")

    def span_start(self, frozen_upto: int) -> int:
        return 0

    def span_end(self, segment_end: int, next_position: int) -> int:
        return segment_end

    def keep_total(self, heads: int, target: int, kept_before: int, candidates: int, keep_ratio: float | None) -> int:
        if self.budget_rule == "naive" and keep_ratio is not None:
            return min(candidates, int(keep_ratio * candidates))
        return max(0, min(candidates, heads * target - kept_before))
