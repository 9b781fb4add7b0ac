"""Exact top-k of short fp32 score rows on the GPU, the selected indices returned in ascending order:
LServe's page selection (a row per query head of at most a few thousand physical pages, k = 63 at
128K). Keys are (score, index) pairs in an int64. A row of at least two parts (PART) is split: one
program per part keeps its best keys (tl.topk, a bitonic sort in registers), then one per row takes
the best of those and sorts the winners' indices. Shorter rows: one program per row does both.
Either beats torch.topk and a sort of its indices (benchmarks/kernels/gpu_top_k.py times them).

Ties: among equal scores at the threshold the lowest indices win, as a stable descending sort would
take them. Scores must not be NaN.

Longer rows (LoopServe's 128K tokens, k = 1024) go to the radix select of radix_top_k.py, which
uses the same key order and tie rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 4096  # longest row this module takes
PART = 512  # rows of at least two parts of max(PART, 2 * next_pow2(k)) scores split over programs


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is x's order (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _keys(x, i, ok):
    """Score in the high half, the index complemented in the low half: the larger key is the larger
    score, then the lower index. Padding gets the smallest int64, below every real key."""
    key = (_ordered(x).to(tl.int64) << 32) | (4294967295 - i.to(tl.int64))
    return tl.where(ok, key, -9223372036854775807 - 1)


@triton.jit
def _store_ascending(top, out_ptr, row, stride_o, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The indices of the K best keys of `top` (BLOCK_K keys, descending), sorted, into row `row`."""
    idx = 4294967295 - (top & 4294967295)
    j = tl.arange(0, BLOCK_K)
    idx = tl.sort(tl.where(j < K, idx, 4611686018427387904))  # the winners past K sort last
    tl.store(out_ptr + row * stride_o + j, idx, mask=j < K)


@triton.jit
def _top_k_small(scores_ptr, out_ptr, n, stride_s, stride_o, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    key = _keys(tl.load(scores_ptr + row * stride_s + i, mask=ok, other=0.0), i, ok)
    _store_ascending(tl.topk(key, BLOCK_K), out_ptr, row, stride_o, K, BLOCK_K)


@triton.jit
def _top_k_part(scores_ptr, cand_ptr, n, stride_s, BLOCK_K: tl.constexpr, PART: tl.constexpr,
                NUM_PARTS: tl.constexpr):
    """The BLOCK_K best keys of one part of a row (stage 1 of the split path)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    i = part * PART + tl.arange(0, PART)
    ok = i < n
    key = _keys(tl.load(scores_ptr + row * stride_s + i, mask=ok, other=0.0), i, ok)
    tl.store(cand_ptr + (row * NUM_PARTS + part) * BLOCK_K + tl.arange(0, BLOCK_K), tl.topk(key, BLOCK_K))


@triton.jit
def _top_k_merge(cand_ptr, out_ptr, stride_o, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """The K best of a row's parts' candidates, their indices ascending (stage 2)."""
    row = tl.program_id(0).to(tl.int64)
    top = tl.topk(tl.load(cand_ptr + row * BLOCK_C + tl.arange(0, BLOCK_C)), BLOCK_K)
    _store_ascending(top, out_ptr, row, stride_o, K, BLOCK_K)


def top_k_ascending(scores: torch.Tensor, k: int, split: bool = True) -> torch.Tensor:
    """scores [..., n] fp32 (no NaN), 1 <= k <= n <= MAX_ROW -> int64 [..., k]: the indices of the k
    largest scores of each row in ascending order; among equal scores at the threshold the lowest.
    split=False: one program per row at any length (benchmarks/kernels/gpu_top_k.py times both)."""
    *lead, n = scores.shape
    assert scores.dtype == torch.float32 and 1 <= k <= n <= MAX_ROW, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    if rows.shape[0] == 0:
        return out.view(*lead, k)
    BLOCK = max(2, triton.next_power_of_2(n))
    BLOCK_K = max(2, triton.next_power_of_2(k))
    part = max(PART, 2 * BLOCK_K)
    parts = BLOCK // part
    if split and parts >= 2:  # a row's parts in parallel, then their candidates merged
        cand = torch.empty(rows.shape[0] * parts * BLOCK_K, dtype=torch.int64, device=scores.device)
        _top_k_part[(rows.shape[0], parts)](rows, cand, n, rows.stride(0), BLOCK_K=BLOCK_K, PART=part,
                                            NUM_PARTS=parts, num_warps=4)
        _top_k_merge[(rows.shape[0],)](cand, out, out.stride(0), K=k, BLOCK_K=BLOCK_K, BLOCK_C=parts * BLOCK_K,
                                       num_warps=4 if parts * BLOCK_K <= 1024 else 8)
    else:
        _top_k_small[(rows.shape[0],)](rows, out, n, rows.stride(0), out.stride(0), K=k, BLOCK_K=BLOCK_K,
                                       BLOCK=BLOCK, num_warps=4 if BLOCK <= 1024 else 8)
    return out.view(*lead, k)
