"""Exact top-k of short fp32 score rows on the GPU, the selected indices returned in ascending order:
LServe's page selection (a row per query head of at most a few thousand physical pages, k = 63 at
128K). Keys are (score, index) pairs in an int64. A row of at least two parts (PART) is split: one
program per part keeps its best keys (tl.topk, a bitonic sort in registers; `candidates`), then one
per row takes the best of those and sorts the winners' indices (`merge_candidates`). A kernel that
uses the winners itself merges in its own program (`merge_ascending`), as LServe's page expansion
does. Shorter rows: one program per row does both. Either beats torch.topk and a sort of its
indices (benchmarks/kernels/gpu_top_k.py times them).

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
def merge_ascending(cand, K, BLOCK_K: tl.constexpr):
    """The indices of the K best of the keys `cand` (a row's candidates, any length >= BLOCK_K) in
    ascending order in the first K of BLOCK_K entries; the entries past K hold 2**62."""
    idx = 4294967295 - (tl.topk(cand, BLOCK_K) & 4294967295)
    j = tl.arange(0, BLOCK_K)
    return tl.sort(tl.where(j < K, idx, 4611686018427387904))


@triton.jit
def _top_k_small(scores_ptr, out_ptr, n, stride_s, stride_o, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    key = _keys(tl.load(scores_ptr + row * stride_s + i, mask=ok, other=0.0), i, ok)
    j = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + row * stride_o + j, merge_ascending(key, K, BLOCK_K), mask=j < K)


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
    idx = merge_ascending(tl.load(cand_ptr + row * BLOCK_C + tl.arange(0, BLOCK_C)), K, BLOCK_K)
    j = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + row * stride_o + j, idx, mask=j < K)


def candidates(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Stage 1 alone, for a kernel that merges in its own program (merge_ascending): scores [..., n]
    fp32 (no NaN), 1 <= k, n <= MAX_ROW -> int64 keys [..., C] (C a power of two, a multiple of
    next_pow2(k)) among which are each row's k best; padding keys rank below every score."""
    *lead, n = scores.shape
    assert scores.dtype == torch.float32 and 1 <= k and n <= MAX_ROW, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    BLOCK_K = max(2, triton.next_power_of_2(k))
    BLOCK = max(BLOCK_K, triton.next_power_of_2(n))
    part = min(BLOCK, max(PART, 2 * BLOCK_K))
    parts = BLOCK // part
    cand = torch.empty(rows.shape[0], parts * BLOCK_K, dtype=torch.int64, device=scores.device)
    if rows.shape[0]:
        _top_k_part[(rows.shape[0], parts)](rows, cand, n, rows.stride(0), BLOCK_K=BLOCK_K, PART=part,
                                            NUM_PARTS=parts, num_warps=4)
    return cand.view(*lead, parts * BLOCK_K)


def merge_candidates(cand: torch.Tensor, k: int) -> torch.Tensor:
    """Stage 2: keys [..., C] from candidates / as_candidates (C >= next_pow2(k)) -> int64 [..., k],
    the indices of each row's k best keys in ascending order."""
    *lead, C = cand.shape
    BLOCK_K = max(2, triton.next_power_of_2(k))
    assert cand.dtype == torch.int64 and C >= BLOCK_K and C & (C - 1) == 0, (cand.dtype, C, k)
    rows = cand.reshape(-1, C).contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=cand.device)
    if rows.shape[0]:
        _top_k_merge[(rows.shape[0],)](rows, out, out.stride(0), K=k, BLOCK_K=BLOCK_K, BLOCK_C=C,
                                       num_warps=4 if C <= 1024 else 8)
    return out.view(*lead, k)


def as_candidates(indices: torch.Tensor) -> torch.Tensor:
    """Chosen indices [..., k] (any top-k's, k < 2**32) -> keys [..., next_pow2(k)] that
    merge_ascending takes back to the same indices (equal scores: the lowest index ranks first;
    padding ranks last)."""
    k = indices.shape[-1]
    keys = 4294967295 - indices.long()
    pad = max(2, triton.next_power_of_2(k)) - k
    return torch.nn.functional.pad(keys, (0, pad), value=-9223372036854775807 - 1)


def top_k_ascending(scores: torch.Tensor, k: int, split: bool = True) -> torch.Tensor:
    """scores [..., n] fp32 (no NaN), 1 <= k <= n <= MAX_ROW -> int64 [..., k]: the indices of the k
    largest scores of each row in ascending order; among equal scores at the threshold the lowest.
    split=False: one program per row at any length (benchmarks/kernels/gpu_top_k.py times both)."""
    *lead, n = scores.shape
    assert scores.dtype == torch.float32 and 1 <= k <= n <= MAX_ROW, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    BLOCK = max(2, triton.next_power_of_2(n))
    BLOCK_K = max(2, triton.next_power_of_2(k))
    if split and BLOCK // max(PART, 2 * BLOCK_K) >= 2:  # a row's parts in parallel, then their candidates merged
        return merge_candidates(candidates(rows, k), k).view(*lead, k)
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    if rows.shape[0]:
        _top_k_small[(rows.shape[0],)](rows, out, n, rows.stride(0), out.stride(0), K=k, BLOCK_K=BLOCK_K,
                                       BLOCK=BLOCK, num_warps=4 if BLOCK <= 1024 else 8)
    return out.view(*lead, k)
