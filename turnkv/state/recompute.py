"""Drop the KV and prefill the history again when the conversation returns (the RE baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.kv.snapshot import Layout, layout_of, slots_of
from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import register
from turnkv.state.base import Stored


@register("state", "recompute")
@dataclass
class RecomputeStrategy(StateStrategy):
    """Store only the token history; re-prefill it on return (exact without eviction).

    After eviction the heads keep the positions they held (from a full-cache recompute, so their
    values are those of the uncompressed history, not bit-identical to the evicted run's)."""

    def pack(self, ctx, seq, window, tier="cpu", prepared=None) -> Stored:
        layout = layout_of(seq)
        return Stored(layout.meta(), layout.tensors())

    def restore(self, ctx, seq, tokens, meta, tensors):
        layout = Layout.from_stored(meta, tensors)
        n = layout.next_position
        if n > len(tokens):
            raise ValueError(f"the stored state covers {n} tokens and the history has {len(tokens)}")
        if n:
            ctx.runner.prefill(seq, tokens[:n])
        if not layout.is_contiguous():
            for layer in range(seq.pool.num_layers):
                pos = layout.layer_positions(layer, seq.pool.device)
                counts = np.asarray(layout.lengths[layer])
                seq.keep(layer, list(torch.split(pos, counts.tolist())))
        for layer, mass in enumerate(layout.masses):
            if mass is not None:  # H2O's statistic is history, not something a prefill recomputes
                seq.pool.attention_mass[layer].view(-1).index_copy_(0, slots_of(seq, layer), mass.to(seq.pool.device))
        return None


def full_layout_meta(num_layers: int, num_kv_heads: int, next_position: int) -> dict:
    """The layout of an uncompressed history: what a corrupt state falls back to recomputing."""
    return {"lengths": [[next_position] * num_kv_heads for _ in range(num_layers)], "next_position": next_position,
            "recomputable": True}

