"""Tri-shape prefill (the LoopServe paper's baseline): A-shape plus dense attention for the last rows,
which are the rows closest to the question and to the first generated token."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.attention.lines import Keys
from turnkv.methods.a_shape import a_shape_mask
from turnkv.methods.pattern_hook import fixed_pattern
from turnkv.methods.registry import register


@register("prefill", "tri_shape")
@dataclass
class TriShape:
    """Tri-shape prefill: A-shape (128 + 4096) + the last 128 rows of each prefill chunk dense.

    The engine prefills long prompts in chunks; the last rows are those of the chunk, so the prompt's
    final chunk has its last `last` rows dense (earlier chunks too: a little more than the paper)."""

    sink: int = 128
    local: int = 4096
    last: int = 128

    def __post_init__(self):
        if self.sink < 0 or self.local < 1 or self.last < 0:
            raise ValueError("sink and last must be >= 0 and local >= 1")

    def attend(self, layer: int, keys: Keys):
        def mask(rows):
            dense_rows = keys.q_pos[:, None, rows, None] >= keys.end_position - self.last
            return a_shape_mask(keys, rows, self.sink, self.local) | (keys.visible(rows) & dense_rows)

        return fixed_pattern(layer, keys, mask)
