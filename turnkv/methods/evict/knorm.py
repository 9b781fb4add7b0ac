"""Knorm: keep the keys with the smallest L2 norm.

Based on Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv 2406.11430). Needs no queries, so it is question-agnostic by construction.

Parameters
----------
compat : str, default "authors"
    "kvpress" is the same rule (kvpress's KnormPress is the authors' code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from turnkv.methods.evict.compat import COMPATS
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


@register("scorer", "knorm")
@dataclass
class KnormScorer(Scorer):
    """Knorm: low key norm means high attention; keep the smallest norms."""

    stacks_layers: ClassVar[bool] = True
    compat: str = "authors"

    def __post_init__(self):
        if self.compat not in COMPATS:
            raise ValueError(f"compat must be one of {', '.join(COMPATS)}")

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)
