"""Slot tables for a decode step whose sequences read a selection of their kept tokens.

A decode selector (one per conversation) answers, per layer, which entries of each head's list its
next query reads: `entries(layer, seq) -> (entries [R, W] long, counts [R] numpy)` with R = KV heads
(row r reads KV head r) or query heads (row r reads KV head r // G), the first counts[r] entries of
row r valid and ascending; or None to read everything. The step turns entries into pool slots, one
row per (sequence, row) for indexed_decode over the pool seen as single-slot pages (page_size 1).
"""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode


def tables(step, layer: int, q: torch.Tensor):
    """(table [B, R, W] int32, lengths [B, R] int32, splits) for the batch, or None when no sequence
    reads a selection in this layer (the step's paged tables serve it unchanged)."""
    picks = [sel.entries(layer, seq) if sel is not None else None for sel, seq in zip(step.selectors, step.seqs)]
    if all(p is None for p in picks):
        return None
    pool = step.pool
    H, Hq, ps = pool.num_kv_heads, q.shape[1], pool.page_size
    # Per-query-head rows if any sequence selects per query head; per-KV-head picks are repeated.
    rows = Hq if any(p is not None and p[0].shape[0] == Hq for p in picks) else H
    slot_rows, counts = [], []
    for pick, seq in zip(picks, step.seqs):
        lengths = seq.lengths[layer]
        if pick is None:  # this sequence reads everything: its entries in order
            width = int(lengths.max())
            entries = torch.arange(width, device=pool.device).expand(H, width)
            count = lengths
        else:
            entries, count = pick
        if entries.shape[0] != rows:
            entries = entries.repeat_interleave(rows // entries.shape[0], dim=0)
            count = np.repeat(count, rows // len(count))
        head = torch.arange(rows, device=pool.device) // (rows // H)
        page_table = seq.device_table()[layer][head]  # [rows, P]
        pages = page_table.gather(1, (entries // ps).clamp_max(page_table.shape[1] - 1))
        slot_rows.append(pages * ps + entries % ps)
        counts.append(np.asarray(count))
    width = max(s.shape[1] for s in slot_rows)
    table = torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[1])) for s in slot_rows]).to(torch.int32)
    lengths = torch.from_numpy(np.stack(counts).astype(np.int32)).to(pool.device)
    splits = decode.num_splits(pool.device, len(picks) * rows, width, pool.kv_dtype, selected=True)
    return table, lengths, splits
