"""SnapKV: keep the tokens the last prompt queries attend to (Li et al., arXiv 2404.14469; the authors' code).

Scores [H, S] per KV head: the window's softmax attention over every key it sees, averaged over the
window's queries and over each KV group's query heads (GQA), pooled along the keys before the window
(stride 1, zero padding; "avg" divides by the kernel width); the window's tokens always stay.
Parameters: window (32; kvpress 64), kernel (5, odd), pooling ("avg" or "max"), compat ("authors" or
"kvpress"). Design and defaults: docs/methods/baselines.md#snapkv"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from turnkv.methods.evict.compat import resolve
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register

DEFAULTS = {"authors": {"window": 32, "kernel": 5}, "kvpress": {"window": 64, "kernel": 5}}


def pool_along_keys(scores: torch.Tensor, kernel: int, pooling: str, include: torch.Tensor) -> torch.Tensor:
    """Pool [H, S] scores along the keys, the columns outside `include` (the window, padding) read as
    absent: -inf for max pooling, 0 for average pooling, which always divides by the kernel width."""
    if kernel <= 1:
        return scores
    pad = kernel // 2
    if pooling == "max":
        masked = scores.masked_fill(~include, float("-inf"))
        return F.max_pool1d(masked[:, None], kernel, stride=1, padding=pad)[:, 0]
    return F.avg_pool1d((scores * include)[:, None], kernel, stride=1, padding=pad, count_include_pad=True)[:, 0]


@register("scorer", "snapkv")
@dataclass
class SnapKVScorer(Scorer):
    """SnapKV: attention of the observation window, pooled along the keys; the window stays."""

    stacks_layers: ClassVar[bool] = True
    window: int | None = None
    kernel: int | None = None
    pooling: str = "avg"
    compat: str = "authors"

    def __post_init__(self):
        resolve(self, DEFAULTS)
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError("window must be >= 1 and kernel a positive odd number")
        if self.pooling not in ("max", "avg"):
            raise ValueError("pooling must be 'max' or 'avg'")
        if self.compat == "kvpress" and self.pooling != "avg":
            raise ValueError("kvpress pools by average only")

    def score(self, view: LayerView) -> torch.Tensor:
        attention = view.window_attention().mean(dim=1)  # [Hq, S]
        in_window = view.positions >= view.query_positions.min()
        # The window's own columns take no part in the pooling (the authors' code pools P[:, :n - window]).
        scores = pool_along_keys(view.group_mean(attention), self.kernel, self.pooling, view.valid & ~in_window)
        return scores.masked_fill(in_window, float("inf"))
