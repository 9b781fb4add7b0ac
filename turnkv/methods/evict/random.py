"""Random eviction, the control every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


@register("scorer", "random")
@dataclass
class RandomScorer(Scorer):
    """Random scores (seeded per layer), as a control."""

    seed: int = 0

    def score(self, view: LayerView) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1000003 + view.layer * 7919 + view.next_position)
        return torch.rand(view.positions.shape, generator=generator).to(view.keys.device)
