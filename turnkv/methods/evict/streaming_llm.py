"""StreamingLLM: keep the first tokens (attention sinks) and the most recent ones.

Based on Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453).
Positions are not re-rotated: kept keys stay at their original positions, as kvpress does.

Parameters
----------
sinks : int, default 4
    Tokens at the start of the conversation that always stay.
compat : str, default "authors"
    "kvpress" is the same rule (kvpress's StreamingLLMPress keeps the sinks and the newest tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from turnkv.methods.evict.compat import COMPATS
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


@register("scorer", "streaming_llm")
@dataclass
class StreamingLLMScorer(Scorer):
    """StreamingLLM: attention sinks plus the most recent tokens."""

    stacks_layers: ClassVar[bool] = True
    sinks: int = 4
    compat: str = "authors"

    def __post_init__(self):
        if self.compat not in COMPATS:
            raise ValueError(f"compat must be one of {', '.join(COMPATS)}")

    def score(self, view: LayerView) -> torch.Tensor:
        recency = view.positions.float()
        return recency.masked_fill(view.positions < self.sinks, float("inf"))
