"""TOVA: keep the tokens the newest query attends to most.

Based on Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104): the score is the
attention of the last query, averaged over the query heads of each KV group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


@register("scorer", "tova")
@dataclass
class TOVAScorer(Scorer):
    """TOVA: attention weights of the last query."""

    window: int = 1

    def score(self, view: LayerView) -> torch.Tensor:
        return view.group_mean(view.window_attention()[:, -1])
