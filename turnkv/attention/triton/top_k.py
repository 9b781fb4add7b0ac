"""Exact top-k of long rows as ascending indices, by radix select: LoopServe's re-selection keeps the
`budget` highest of ~128K window scores per row, inside the decode graph.

`torch.topk` followed by a sort of the chosen indices took about 200 us per layer for 32 rows of 128K
on an H100 (a multi-block radix select in seven launches, then a radix sort), longer than the two
passes that compute the scores. Here one program per row finds the k-th largest value with three
histogram passes over the row (the order-preserving 32-bit key of each fp32, 11 + 11 + 10 bits),
then writes, in one more pass in index order, every index above that value and the first ones equal
to it until k are taken: the output comes out ascending, with no sort. The row (512 KB at 128K) was
just written by the score kernel, so the passes read it from L2.

Ties at the k-th value take the lowest indices (torch.topk leaves the choice open); indices at or
past the row's `history` are written as `pad` (LoopServe's padding past the valid entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """fp32 -> uint32 with the same order: negative floats have every bit flipped, others the sign bit."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, ~b, b ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _kth_bin(hist, need, BINS: tl.constexpr):
    """The highest bin b with count(bins >= b) >= need, and how many of `need` are left for bin b."""
    i = tl.arange(0, BINS)
    flipped = tl.flip(hist, 0)  # flipped[i] = hist[BINS - 1 - i]
    at_or_above = tl.cumsum(flipped, 0)
    first = tl.min(tl.where(at_or_above >= need, i, BINS), 0)
    above = tl.sum(tl.where(i == first, at_or_above - flipped, 0), 0)
    return BINS - 1 - first, need - above


@triton.jit
def _top_k_rows(x_ptr, out_ptr, history_ptr, stride_x, stride_o, n, pad,
                K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([2048], tl.int32)
    for start in range(0, n, BLOCK):  # pass 1: bits 31..21
        idx = start + offs
        key = _order_key(tl.load(x_row + idx, mask=idx < n, other=0.0))
        hist += tl.histogram((key >> 21).to(tl.int32), 2048, mask=idx < n)
    top, need = _kth_bin(hist, K, 2048)
    hist = tl.zeros([2048], tl.int32)
    for start in range(0, n, BLOCK):  # pass 2: bits 20..10 of the keys in that bin
        idx = start + offs
        key = _order_key(tl.load(x_row + idx, mask=idx < n, other=0.0))
        match = (idx < n) & ((key >> 21).to(tl.int32) == top)
        hist += tl.histogram(((key >> 10) & 0x7FF).to(tl.int32), 2048, mask=match)
    mid, need = _kth_bin(hist, need, 2048)
    prefix = top * 2048 + mid  # key >> 10 of the k-th largest
    hist = tl.zeros([1024], tl.int32)
    for start in range(0, n, BLOCK):  # pass 3: bits 9..0
        idx = start + offs
        key = _order_key(tl.load(x_row + idx, mask=idx < n, other=0.0))
        match = (idx < n) & ((key >> 10).to(tl.int32) == prefix)
        hist += tl.histogram((key & 0x3FF).to(tl.int32), 1024, mask=match)
    low, need = _kth_bin(hist, need, 1024)
    kth = (prefix.to(tl.uint32) << 10) | low.to(tl.uint32)  # the k-th largest key; take `need` equal to it
    history = tl.load(history_ptr + row)
    taken = 0
    ties = 0
    for start in range(0, n, BLOCK):  # pass 4: write in index order
        idx = start + offs
        ok = idx < n
        key = _order_key(tl.load(x_row + idx, mask=ok, other=0.0))
        eq = (ok & (key == kth)).to(tl.int32)
        take = (ok & (key > kth)) | ((eq != 0) & (ties + tl.cumsum(eq, 0) - eq < need))
        take_i = take.to(tl.int32)
        pos = taken + tl.cumsum(take_i, 0) - take_i
        tl.store(out_ptr + row * stride_o + pos, tl.where(idx < history, idx, pad).to(tl.int64), mask=take)
        taken += tl.sum(take_i, 0)
        ties += tl.sum(eq, 0)


def top_k_ascending(x: torch.Tensor, k: int, history: torch.Tensor, pad: int, block: int = 2048) -> torch.Tensor:
    """x [..., n] fp32 -> int64 [..., k]: per row the indices of its k largest values, ascending, with
    indices >= history (per row, broadcast from [...]) replaced by `pad`. Needs k <= n."""
    *lead, n = x.shape
    assert x.dtype == torch.float32 and x.stride(-1) == 1 and 0 < k <= n
    rows = x.reshape(-1, n)
    hist = history.expand(*lead).reshape(-1).to(torch.int32)
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=x.device)
    _top_k_rows[(rows.shape[0],)](rows, out, hist, rows.stride(0), out.stride(0), n, pad, K=k, BLOCK=block,
                                  num_warps=8)
    return out.view(*lead, k)
