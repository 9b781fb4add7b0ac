"""A sequence's kept history in one layer as K/V blocks that dense attention reads without a gather.

A prefill slice takes its pages off the free stack in one piece: each head gets consecutive page ids,
head h's run starting a fixed number of pages after head h-1's. Such a run of page-table columns is
one strided view of the pool, [1, H, pages * page_size, D], which cuDNN's attention reads in place.
The columns outside long runs (decode steps' single pages, a partly filled last page, a pool whose
free stack is scattered) are gathered into one more block. Attention over a history where every key
is visible does not depend on the keys' order, so the blocks may come in any order.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from turnkv.kv.pool import PagePool

# A run shorter than this is gathered: a view saves a copy of its keys but costs one more attention
# call and one more merge of the chunk's rows.
MIN_RUN_TOKENS = 4096
MAX_RUNS = 8


class Run(NamedTuple):
    """Table columns column .. column + pages - 1, where head h's page at column column + i is
    first_page + h * head_stride + i."""

    column: int
    pages: int
    first_page: int
    head_stride: int


def page_runs(table: np.ndarray, min_pages: int = 1) -> list[Run]:
    """The maximal runs of a layer's page table [H, P] (int page ids) at least min_pages long, in
    column order."""
    H, P = table.shape
    if P == 0:
        return []
    base = table[0]
    if H > 1:
        stride = table[1] - base
        regular = (stride > 0) & (table == base + np.arange(H)[:, None] * stride).all(axis=0)
    else:
        stride, regular = np.ones(P, dtype=table.dtype), np.ones(P, dtype=bool)
    # Column c carries on column c - 1's run.
    carries = np.zeros(P, dtype=bool)
    carries[1:] = regular[1:] & regular[:-1] & (base[1:] == base[:-1] + 1) & (stride[1:] == stride[:-1])
    starts = np.flatnonzero(~carries)
    ends = np.append(starts[1:], P)
    keep = regular[starts] & (ends - starts >= min_pages)
    return [Run(int(c), int(e - c), int(base[c]), int(stride[c])) for c, e in zip(starts[keep], ends[keep])]


def run_view(store: torch.Tensor, layer: int, run: Run, num_heads: int) -> torch.Tensor:
    """A run's rows of a pool tensor [layers, pages, page_size, D] -> a view [1, H, pages * page_size, D]."""
    _, num_pages, ps, D = store.shape
    head = run.head_stride * ps * D
    offset = store.storage_offset() + (layer * num_pages + run.first_page) * ps * D
    return store.as_strided((1, num_heads, run.pages * ps, D), (num_heads * head, head, D, 1), offset)


def history_blocks(pool: PagePool, layer: int, table: np.ndarray, device_table: torch.Tensor,
                   length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) blocks [1, H, n_i, D] whose keys together are the first `length` slots of every head of
    one sequence in `layer`: table [H, P] its page table on the host, device_table [1, H, P] the same
    on the pool's device. Runs of at least MIN_RUN_TOKENS as views (the MAX_RUNS longest; a pool in the
    compute dtype only), the rest gathered into one block."""
    ps = pool.page_size
    runs = []
    if not pool.quantized:
        runs = page_runs(table[:, : length // ps], max(1, MIN_RUN_TOKENS // ps))
        runs = sorted(runs, key=lambda r: -r.pages)[:MAX_RUNS]
    if not runs:
        return [(pool.gather(layer, device_table, length, "k"), pool.gather(layer, device_table, length, "v"))]
    H = pool.num_kv_heads
    blocks = [(run_view(pool.k, layer, r, H), run_view(pool.v, layer, r, H)) for r in runs]
    rest = np.ones(-(-length // ps), dtype=bool)
    for r in runs:
        rest[r.column : r.column + r.pages] = False
    columns = np.flatnonzero(rest)
    if len(columns):
        # A partly filled last page is the last of these columns: the gather reads its first slots.
        rest_length = len(columns) * ps - (-length % ps)
        pages = torch.from_numpy(np.ascontiguousarray(table[:, columns]))[None]
        if pool.device.type == "cuda":  # pinned, so the copy does not wait for the steps in flight
            pages = pages.pin_memory().to(pool.device, non_blocking=True)
        blocks.append((pool.gather(layer, pages, rest_length, "k"), pool.gather(layer, pages, rest_length, "v")))
    return blocks
