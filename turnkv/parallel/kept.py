"""What a conversation keeps, in the whole model's head numbering: for comparing runs at any N."""

from __future__ import annotations

import numpy as np

from turnkv.parallel.mirror import gather


def local_kept(conv) -> dict[tuple[int, int], tuple[int, ...]]:
    """{(layer, global KV head): the positions it holds, ascending} of `conv` on this rank."""
    shard = getattr(conv.llm.model, "shard", None)
    kv = conv.kv
    L, H = kv.lengths.shape
    heads = np.arange(H) if shard is None else shard.kv_heads
    out = {}
    for layer in range(L):
        positions = kv.gather_positions([layer])[0].cpu().numpy()  # [H, S]
        for h in range(H):
            out[(layer, int(heads[h]))] = tuple(sorted(positions[h, : kv.lengths[layer, h]].tolist()))
    return out


def kept(conv) -> dict[tuple[int, int], tuple[int, ...]]:
    """{(layer, KV head): positions held} over every rank of conv's engine. ValueError where ranks
    that hold the same head (replicas) disagree."""
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for rank, part in enumerate(gather(conv, local_kept)):
        for key, positions in part.items():
            if out.setdefault(key, positions) != positions:
                raise ValueError(f"rank {rank} holds other positions than another replica of (layer, head) {key}")
    return out
