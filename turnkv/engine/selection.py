"""Slot tables for a decode step whose sequences read a selection of their kept tokens.

A decode selector (one per conversation) answers, per layer, which entries of each head's list its
next query reads: `entries(layer, seq) -> (entries [R, W] long, counts [R] numpy)` with R = KV heads
(row r reads KV head r) or query heads (row r reads KV head r // G), the first counts[r] entries of
row r valid and ascending; or None to read everything. Selectors of one class with equal
`batch_key(layer, seq)` answer together through the class's `entries_batch` (one selection for the
group, e.g. one PageSelector.select call); the others one by one. The step turns the entries into
pool slots, one row per (sequence, row), for indexed_decode over the pool seen as single-slot pages
(page_size 1): one gather through the step's page tables for the whole batch.

The step's other per-layer calls to its selections are grouped once per step as well (Rows,
observer_groups, write_groups): each class observes a layer's queries in one observe_batch call, and
WriteWatchers of one class and equal write_key take a layer's K writes in one step_writes call.
"""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode
from turnkv.gpu import upload
from turnkv.methods.protocols import WriteWatcher


def tables(step, layer: int, q: torch.Tensor):
    """(table [B, R, W] int32, lengths [B, R] int32, splits) for the batch, or None when no sequence
    reads a selection in this layer (the step's paged tables serve it unchanged). q [B, Hq, D]."""
    seqs, pool = step.seqs, step.pool
    layer_tables = step.tables[layer]  # [B, H, P] int32, zero-padded to the widest
    parts = []  # (batch indices [m], entries [m, R, W], counts [m, R]) of the sequences that select
    for batched, members in _groups(step.selectors, seqs, layer):
        first = step.selectors[members[0]]
        if not batched:
            pick = first.entries(layer, seqs[members[0]])
            if pick is not None:
                parts.append((np.asarray(members), pick[0][None], np.asarray(pick[1])[None]))
            continue
        index = upload(np.asarray(members), layer_tables.device) if len(members) < len(seqs) else None
        group_tables = layer_tables if index is None else layer_tables.index_select(0, index)
        picked = type(first).entries_batch(layer, [seqs[b] for b in members],
                                           [step.selectors[b] for b in members], group_tables)
        if picked is not None:
            which, entries, counts = picked
            parts.append((np.asarray(members)[which], entries, np.asarray(counts)))
    if not parts:
        return None
    B, H, Hq, ps = len(seqs), pool.num_kv_heads, q.shape[1], pool.page_size
    lengths = np.stack([seq.lengths[layer] for seq in seqs])  # [B, H], this step's token included
    # Per-query-head rows if any sequence selects per query head; per-KV-head rows are repeated.
    rows = Hq if any(entries.shape[1] == Hq for _, entries, _ in parts) else H
    entries, counts = _merge(parts, lengths, rows, pool.device)
    # Each row's entries through its KV head's page table: pool slots.
    head_tables = layer_tables
    if rows != H:
        head_tables = layer_tables.index_select(1, torch.arange(rows, device=pool.device) // (rows // H))
    pages = head_tables.gather(2, (entries // ps).clamp_max(head_tables.shape[2] - 1))
    table = (pages * ps + entries % ps).to(torch.int32)
    width = entries.shape[2]
    splits = decode.num_splits(pool.device, B * rows, width, pool.kv_dtype, selected=True)
    return table, upload(counts.astype(np.int32), pool.device), splits


def _groups(selectors, seqs, layer: int) -> list[tuple[bool, list[int]]]:
    """The batch indices of the sequences with a selector, grouped: (True, members) for equal (class,
    batch_key), (False, [b]) for a None key; in order of first appearance, members ascending."""
    groups: dict = {}
    for b, (sel, seq) in enumerate(zip(selectors, seqs)):
        if sel is not None:
            key = sel.batch_key(layer, seq)
            groups.setdefault((True, type(sel), key) if key is not None else (False, b), []).append(b)
    return [(key[0], members) for key, members in groups.items()]


def _merge(parts, lengths: np.ndarray, rows: int, device) -> tuple[torch.Tensor, np.ndarray]:
    """The parts' entries [m, R, W] placed at their sequences' rows of one [B, rows, W] int64 tensor
    (R < rows: each row repeated rows // R times), and counts [B, rows]; a sequence in no part reads
    every kept token: entries 0..W-1, its heads' lengths as counts. W covers every part and every
    such sequence's longest head. lengths [B, H]."""
    B, H = lengths.shape
    selecting = np.concatenate([index for index, _, _ in parts])
    rest = np.setdiff1d(np.arange(B), selecting)
    width = max(max(entries.shape[2] for _, entries, _ in parts), int(lengths[rest].max(initial=0)))
    if len(parts) == 1 and len(rest) == 0 and parts[0][1].shape[1:] == (rows, width):
        index, entries, counts = parts[0]
        if np.array_equal(index, np.arange(B)):
            return entries, counts
    out = torch.arange(width, device=device).repeat(B, rows, 1)
    counts = np.repeat(lengths, rows // H, axis=1)
    for index, entries, part_counts in parts:
        R = entries.shape[1]
        if R != rows:
            entries = entries.repeat_interleave(rows // R, dim=1)
            part_counts = np.repeat(part_counts, rows // R, axis=1)
        entries = torch.nn.functional.pad(entries, (0, width - entries.shape[2]))
        out[upload(index, device)] = entries
        counts[index] = part_counts
    return out, counts


# ---- a step's per-layer calls to its selections, grouped once per step --------------------------------
class Rows:
    """Some rows of a step's batch, [m] ascending indices into its B sequences: picks them out of any
    tensor whose first axis is the batch (the tensor itself, a slice view, or one index_select)."""

    def __init__(self, members: list[int], batch: int, device):
        self.members = members
        self.index = None
        self.span = None
        if members != list(range(batch)):
            if members == list(range(members[0], members[-1] + 1)):
                self.span = slice(members[0], members[-1] + 1)
            else:
                self.index = upload(np.asarray(members), device)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            return t.index_select(0, self.index)
        return t if self.span is None else t[self.span]


def observer_groups(observers, device) -> list[tuple[type, list, Rows]]:
    """(class, its selections, their rows) per class of the step's selections (None: no selection):
    each class observes a layer's queries in one observe_batch call."""
    groups: dict = {}
    for b, sel in enumerate(observers):
        if sel is not None:
            groups.setdefault(type(sel), []).append(b)
    return [(cls, [observers[b] for b in members], Rows(members, len(observers), device))
            for cls, members in groups.items()]


def write_groups(observers, seqs, num_new: int, device) -> list[tuple[Rows, object]]:
    """(rows, written(layer, slots [m, H, T], k [m, T, H, D])) per group of the step's WriteWatchers:
    those of one class and equal write_key share one step_writes; the others write alone."""
    groups: dict = {}
    for b, (sel, seq) in enumerate(zip(observers, seqs)):
        if isinstance(sel, WriteWatcher):
            key = sel.write_key(seq)
            groups.setdefault((type(sel), key) if key is not None else b, []).append(b)
    out = []
    for key, members in groups.items():
        rows = Rows(members, len(seqs), device)
        if isinstance(key, tuple):
            written = key[0].step_writes([seqs[b] for b in members], [observers[b] for b in members], num_new)
        else:
            written = _alone(observers[key], seqs[key])
        out.append((rows, written))
    return out


def _alone(watcher, seq):
    def written(layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        watcher.written(layer, seq, slots.reshape(-1), k[0])

    return written
