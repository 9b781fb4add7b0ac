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

    def allocate_layers(self, scores: torch.Tensor, totals) -> torch.Tensor:
        protected, free = protected_and_capacity(scores)  # [T, H] each
        totals = torch.as_tensor([int(x) for x in totals], dtype=torch.int64)
        per_head = (totals.double() / scores.shape[1])[:, None] - protected
        return protected + fit_counts(per_head, free, totals - protected.sum(dim=1))
