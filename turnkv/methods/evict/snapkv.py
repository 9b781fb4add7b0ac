"""SnapKV: keep the tokens the last prompt queries attend to.

Based on Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469),
with Ada-KV's GQA handling: the window's attention (softmax over every key it sees) is averaged over
the window's queries and over the query heads of each KV group, max-pooled along the keys, and the
window's own tokens always stay.

Parameters
----------
window : int, default 32
    Observation window: the last `window` queries score the keys; their tokens are protected.
kernel : int, default 7
    Width of the 1-D pooling along the key axis (odd).
pooling : str, default "max"
    "max" (the paper and Ada-KV) or "avg" (kvpress).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


def pool_along_keys(scores: torch.Tensor, kernel: int, pooling: str, include: torch.Tensor) -> torch.Tensor:
    """Pool [H, S] scores along the keys over the `include`d columns only (not the window, not padding)."""
    if kernel <= 1:
        return scores
    pad = kernel // 2
    if pooling == "max":
        masked = scores.masked_fill(~include, float("-inf"))
        return F.max_pool1d(masked[:, None], kernel, stride=1, padding=pad)[:, 0]
    weight = include.float()[:, None]
    total = F.avg_pool1d((scores * include)[:, None], kernel, stride=1, padding=pad, count_include_pad=True)
    count = F.avg_pool1d(weight, kernel, stride=1, padding=pad, count_include_pad=True)
    return (total / count.clamp(min=1e-12))[:, 0]


@register("scorer", "snapkv")
@dataclass
class SnapKVScorer(Scorer):
    """SnapKV: attention of the observation window, pooled along the keys; the window stays."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError("window must be >= 1 and kernel a positive odd number")
        if self.pooling not in ("max", "avg"):
            raise ValueError("pooling must be 'max' or 'avg'")

    def score(self, view: LayerView) -> torch.Tensor:
        attention = view.window_attention().mean(dim=1)  # [Hq, S]
        in_window = view.positions >= view.query_positions.min()
        # As in the paper's code: the window's own columns take no part in the pooling.
        scores = pool_along_keys(view.group_mean(attention), self.kernel, self.pooling, view.valid & ~in_window)
        return scores.masked_fill(in_window, float("inf"))
