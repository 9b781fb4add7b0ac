"""Uniform allocation: every KV head of a layer keeps the same number of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.counts import fit_counts, protected_and_capacity
from turnkv.methods.protocols import Allocator
from turnkv.methods.registry import register


@register("allocator", "uniform")
@dataclass
class UniformAllocator(Allocator):
    """The same budget for every head of a layer (what SnapKV, H2O and PyramidKV do)."""

    def allocate(self, scores: torch.Tensor, total: int) -> torch.Tensor:
        protected, free = protected_and_capacity(scores)
        H = scores.shape[0]
        per_head = torch.full((H,), total / H, dtype=torch.float64)
        return protected + fit_counts(per_head - protected, free, total - int(protected.sum()))
