"""Random eviction, the control every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register
from turnkv.model.parallel import all_max


@register("scorer", "random")
@dataclass
class RandomScorer(Scorer):
    """Random scores (seeded per layer), as a control."""

    seed: int = 0

    def score(self, view: LayerView) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1000003 + view.layer * 7919 + view.next_position)
        H, S = view.positions.shape
        if view.shard is None:
            return torch.rand((H, S), generator=generator).to(view.keys.device)
        # Tensor parallel: the whole layer's draw over every head and the longest head of any rank,
        # of which this rank's heads take their part.
        longest = all_max(S, view.shard, view.keys.device)
        whole = torch.rand((view.shard.config.num_kv_heads, longest), generator=generator)
        return whole[torch.from_numpy(view.shard.kv_heads), :S].to(view.keys.device)
