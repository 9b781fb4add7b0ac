"""Dense prefill: every new token attends to every kept token and to the new ones before it."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.attention.lines import Keys
from turnkv.methods.prefill.pattern_hook import fixed_pattern
from turnkv.methods.protocols import Prefill
from turnkv.methods.registry import register


@register("prefill", "dense")
@dataclass
class DensePrefill(Prefill):
    """Dense causal prefill (no sparsity)."""

    sparse = False  # the engine's own dense path runs; attend is the same attention on the mask path
    path_independent = True

    def attend(self, layer: int, keys: Keys):
        return fixed_pattern(layer, keys, keys.visible)
