"""PyramidKV: SnapKV's scores with a layer-wise budget pyramid, more tokens in shallow layers.

Based on Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv 2406.02069), with the schedule of the Ada-KV code: per-head budgets (window
excluded) fall linearly from 2b - b/beta in layer 0 to b/beta in the last layer, so the average is b.

Parameters
----------
window, kernel, pooling : as SnapKV.
beta : int, default 20
    Ratio between the average budget and the last layer's.
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

    def layer_target(self, target: int, layer: int, num_layers: int, available: int) -> int:
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
