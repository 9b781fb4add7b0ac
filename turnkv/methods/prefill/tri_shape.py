"""Tri-shape prefill (the LoopServe paper's baseline): A-shape plus dense attention for the last rows,
which are the rows closest to the question and to the first generated token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.attention import lines
from turnkv.attention.lines import Keys
from turnkv.methods.prefill.a_shape import a_shape_lines, a_shape_mask
from turnkv.methods.prefill.pattern_hook import clock, fixed_pattern, since, with_times
from turnkv.methods.protocols import Prefill
from turnkv.methods.registry import register


@register("prefill", "tri_shape")
@dataclass
class TriShapePrefill(Prefill):
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

        if lines.uses_kernel(keys.q.device):
            split = self._first_dense_row(keys)
            if split is not None:
                return self._attend_lines(layer, keys, split)
        return fixed_pattern(layer, keys, mask)

    def _first_dense_row(self, keys: Keys) -> int | None:
        """The first row of the dense tail when every sequence's rows sit at the same positions (then
        the tail is one row range), else None (the mask path handles ragged batches)."""
        same, first = torch.stack([(keys.q_pos == keys.q_pos[:1]).all().long(), keys.q_pos[0, 0]]).tolist()
        if not same:
            return None
        return min(max(keys.end_position - self.last - first, 0), keys.q.shape[2])

    def _attend_lines(self, layer: int, keys: Keys, split: int):
        """The line kernel twice: the A-shape's lines for the rows before the tail, every offset (dense
        causal, one sweep of key blocks) for the tail."""
        t0 = clock(keys.q.device)
        parts = []
        if split > 0:
            head = keys.row_slice(0, split)
            parts.append(lines.line_attention(head, *a_shape_lines(head, self.sink, self.local),
                                              mask_fn=lambda r: a_shape_mask(head, r, self.sink, self.local)))
        if split < keys.q.shape[2]:
            tail = keys.row_slice(split, keys.q.shape[2])
            B, H, S = keys.k_pos.shape
            none = torch.zeros(B * H, S, dtype=torch.bool, device=keys.q.device)
            every = torch.ones(B * H, keys.end_position, dtype=torch.bool, device=keys.q.device)
            parts.append(lines.line_attention(tail, none, every, False, mask_fn=tail.visible))
        out = torch.cat([p[0] for p in parts], dim=2)
        computed, causal = sum(p[1] for p in parts), sum(p[2] for p in parts)
        return out, with_times(dict(layer=layer, computed=computed, causal=causal),
                           time_sparse_attention=since(t0, keys.q.device))
