"""A-shape prefill (the LoopServe paper's baseline, from MInference): every row reads the first
`sink` positions and the `local` positions up to itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.attention.lines import Keys
from turnkv.methods.prefill.pattern_hook import fixed_pattern
from turnkv.methods.protocols import Prefill
from turnkv.methods.registry import register


def a_shape_mask(keys: Keys, rows: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """[B, H, R, S]: causal cells whose key position is < sink or within `local` of the row."""
    delta = keys.q_pos[:, None, rows, None] - keys.k_pos[:, :, None, :]
    return keys.visible(rows) & ((keys.k_pos[:, :, None, :] < sink) | (delta < local))


def a_shape_lines(keys: Keys, sink: int, local: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The same cells as lines per KV head, for the line kernel: the keys at positions < sink as
    vertical lines, offsets < local as slash lines. Returns (vertical [B*H, S], slash [B*H, O], False)."""
    B, H, S = keys.k_pos.shape
    vertical = keys.k_pos < sink
    if keys.valid is not None:
        vertical = vertical & keys.valid
    slash = (torch.arange(keys.end_position, device=keys.k_pos.device) < local).expand(B * H, -1)
    return vertical.reshape(B * H, S), slash, False


@register("prefill", "a_shape")
@dataclass
class AShapePrefill(Prefill):
    """A-shape prefill: sink keys + a local window per row (128 + 4096)."""

    sink: int = 128
    local: int = 4096

    def __post_init__(self):
        if self.sink < 0 or self.local < 1:
            raise ValueError("sink must be >= 0 and local >= 1 (a row always reads itself)")

    def attend(self, layer: int, keys: Keys):
        return fixed_pattern(layer, keys, lambda rows: a_shape_mask(keys, rows, self.sink, self.local),
                             lambda: a_shape_lines(keys, self.sink, self.local))
