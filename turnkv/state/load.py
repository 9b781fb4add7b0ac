"""Store the whole KV off the GPU and load it back (the KV baseline, with layer-wise prefetch)."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import register
from turnkv.state.base import Stored
from turnkv.state.split import pack_split, restore_split


@register("state", "load")
@dataclass
class LoadStrategy(StateStrategy):
    """Full KV to the CPU or disk tier; on return it is copied back layer by layer on a side CUDA
    stream, and the next turn's layer l starts as soon as layer l has arrived.

    layerwise : bool, default True
        False waits for the whole KV before the first layer runs (the paper's KV baseline)."""

    layerwise: bool = True

    def pack(self, ctx, seq, window, tier="cpu", prepared=None) -> Stored:
        return Stored(*pack_split(seq, [0] * seq.pool.num_layers, on_host=ctx.stage_on_host))

    def restore(self, ctx, seq, tokens, meta, tensors):
        stream = restore_split(ctx, seq, tokens, meta, tensors)
        if not self.layerwise:
            stream.wait_all()
        return stream
