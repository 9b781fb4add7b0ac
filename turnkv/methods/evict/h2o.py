"""H2O: keep the heavy hitters, the tokens that have received the most attention, plus recent ones.

Based on Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv 2306.14048). Every query the conversation computes (prefill and decode) adds
its attention weights to the mass stored beside each key, summed over the query heads of the KV
group; that running sum is the score. The most recent `recent_ratio` of each head's budget is kept
as the paper's local window.

Parameters
----------
recent_ratio : float, default 0.5
    Share of each head's kept tokens reserved for the most recent tokens (the paper splits 50/50).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


@register("scorer", "h2o")
@dataclass
class H2OScorer(Scorer):
    """H2O: accumulated attention (heavy hitters) plus a recent window."""

    recent_ratio: float = 0.5
    accumulates_attention = True

    def __post_init__(self):
        if not 0 <= self.recent_ratio <= 1:
            raise ValueError("recent_ratio must be in [0, 1]")

    def score(self, view: LayerView) -> torch.Tensor:
        recent = int(self.recent_ratio * view.target)
        newest_first = view.positions.masked_fill(~view.valid, -1).argsort(dim=1, descending=True).argsort(dim=1)
        return view.attention_mass.masked_fill(newest_first < recent, float("inf"))
