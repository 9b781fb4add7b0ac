"""PyramidKV: SnapKV's scores with a layer-wise budget pyramid, more tokens in shallow layers.

Based on Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv 2406.02069), with the schedule of the Ada-KV code: per-head budgets with the window
left out fall linearly from 2b - b/beta in layer 0 to b/beta in the last layer, so the average is b,
and every layer keeps its window on top of its share.

Parameters
----------
window, kernel, pooling : as SnapKV.
beta : int, default 20
    Ratio between the average budget and the last layer's.
compat : str, default "authors"
    "kvpress": kvpress's PyramidKVPress. The window counts inside each layer's budget (the pyramid
    splits the whole per-head target, from 2t - t/beta down to t/beta, rounded per layer), a layer
    whose schedule would fall below the window or above the keys it holds gets the uniform target,
    and SnapKV's kvpress defaults apply (window 64).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.evict.snapkv import SnapKVScorer
from turnkv.methods.registry import register


@register("scorer", "pyramidkv")
@dataclass
class PyramidKVScorer(SnapKVScorer):
    """PyramidKV: SnapKV scores, with a linear budget pyramid over the layers."""

    beta: int = 20

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError("beta must be >= 1")

    def layer_target(self, target: int, layer: int, num_layers: int, available: int) -> int:
        if self.compat == "kvpress":
            return self._kvpress_target(target, layer, num_layers, available)
        b = target - self.window  # the window is kept on top of every layer's share
        if b <= 0 or num_layers == 1:
            return target
        low = b // self.beta
        high = 2 * b - low
        if high >= available - self.window:
            high = available - self.window
            low = 2 * b - high
        step = (high - low) // (num_layers - 1)
        return self.window + high - layer * step

    def _kvpress_target(self, target: int, layer: int, num_layers: int, available: int) -> int:
        low = target / self.beta
        high = 2 * target - low
        if high >= available - self.window:
            high = available - self.window
            low = 2 * target - high
        if not (available >= high >= low >= self.window) or num_layers == 1:
            return target
        step = (high - low) / (num_layers - 1)
        return round(high - layer * step)
