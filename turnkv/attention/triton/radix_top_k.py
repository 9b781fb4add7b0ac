"""Exact top-k of long fp32 score rows on the GPU by radix select, the winners written in ascending
index order: LoopServe's re-selection (a row per query head of every history token, k = 1024 of 128K).

Each score becomes a 32-bit key whose unsigned order is the scores' order. Eight rounds of one
launch each find the k-th largest key four bits at a time: every program of a (row, chunk) grid
counts its chunk's keys that match the digits found so far, per value of the next digit (16 bins,
tl.histogram), and adds the counts into the row's histogram with atomics. A program starts by
walking the earlier rounds' histograms itself, so no launch sits between rounds to pick the digit.
The last round keeps its counts per chunk instead (chunks of WRITE_CHUNK, smaller than the other
rounds'), with each chunk's number of keys above the 28-bit prefix; from those, the write kernel knows how many winners every chunk before its own holds
and writes its winners at their final places: the output comes out sorted, with no sort.

Ties at the threshold go to the lowest indices, as in the short-row kernel (top_k.py) and a stable
descending sort. Scores must not be NaN.

H100, as CUDA-graph replays (benchmarks/gpu_top_k.py, results/h100_top_k.json), k = 1024: 32 rows
x 128K 105.5 us against 128 for torch.topk and a sort of its indices; 8 rows x 128K 46 against 99;
32 rows x 32K 46 against 93. Slower and dropped: the digits counted as a one-hot sum ([chunk, 16] in
registers, 330 us at 32 x 128K) or as 16 masked sums (235 us), and an earlier select in 11-bit
digits whose 2048-bin tl.histogram took about 150 us per round (493 us): few bins, few rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.attention.triton.top_k import _ordered

CHUNK = 8192  # scores per program (H100, 32 x 128K: 110 us against 127 at 4096 and 120 at 16384)
# Scores per program of the last round and the write (their counts are per chunk): the write's two
# cumulative sums run over shorter rows. H100, 32 x 128K: 105.5 us at 2048 against 110.3 at 8192,
# 107.9 at 4096 and 116.7 at 1024.
WRITE_CHUNK = 2048
ROUNDS = 8  # 4-bit digits of a 32-bit key
SIGN: tl.constexpr = tl.constexpr(-2147483648)  # int32 with only the sign bit


@triton.jit
def _descend(hist_ptr, row, R, K, ROUNDS_DONE: tl.constexpr):
    """Walk a row's first ROUNDS_DONE digit histograms from the top: -> (the digits of the k-th
    largest key found so far, high bits first, as an unsigned-order int32; how many of the keys
    that match them are still to take)."""
    b = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.int32)
    need = K
    for r in tl.static_range(ROUNDS_DONE):
        h = tl.load(hist_ptr + (r * R + row) * 16 + b)
        above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in the higher digits
        digit = tl.max(tl.where((above < need) & (above + h >= need), b, -1), 0)
        prefix = prefix | (digit << (28 - 4 * r))
        need = need - tl.sum(tl.where(b == digit, above, 0), 0)
    return prefix, need


@triton.jit
def _radix_round(scores_ptr, hist_ptr, gt_ptr, chunk_hist_ptr, n, R, K, stride_s, num_chunks,
                 ROUND: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = i < n
    x = tl.load(scores_ptr + row.to(tl.int64) * stride_s + i, mask=ok, other=0.0)
    key = _ordered(x)
    ukey = key ^ SIGN  # unsigned order: digits read from the top bit down
    prefix, need = _descend(hist_ptr, row, R, K, ROUND)
    SHIFT: tl.constexpr = 28 - 4 * ROUND
    if ROUND > 0:  # the keys whose higher digits are the k-th largest's
        ok = ok & ((ukey >> (SHIFT + 4)) == (prefix >> (SHIFT + 4)))
    b = tl.arange(0, 16)
    digit = (ukey >> SHIFT) & 15
    counts = tl.histogram(digit, 16, mask=ok)
    if ROUND < 7:
        tl.atomic_add(hist_ptr + (ROUND * R + row) * 16 + b, counts)
    else:  # per chunk, for the write kernel: the low digit's counts and the keys above the prefix
        tl.store(chunk_hist_ptr + (row * num_chunks + chunk) * 16 + b, counts)
        above = (i < n) & ((key >> 4) > ((prefix ^ SIGN) >> 4))
        tl.store(gt_ptr + row * num_chunks + chunk, tl.sum(above.to(tl.int32), 0))


@triton.jit
def _radix_write(scores_ptr, hist_ptr, gt_ptr, chunk_hist_ptr, out_ptr, n, R, K, stride_s, stride_o, num_chunks,
                 CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    prefix, need = _descend(hist_ptr, row, R, K, 7)
    b = tl.arange(0, 16)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_chunks
    per_chunk = tl.load(chunk_hist_ptr + (row * num_chunks + c)[:, None] * 16 + b[None, :], mask=c_ok[:, None],
                        other=0)  # [chunks, 16]
    h = tl.sum(per_chunk, 0)
    above = tl.sum(h, 0) - tl.cumsum(h, 0)
    digit = tl.max(tl.where((above < need) & (above + h >= need), b, -1), 0)
    take_equal = need - tl.sum(tl.where(b == digit, above, 0), 0)  # winners equal to the threshold
    threshold = (prefix | digit) ^ SIGN  # the k-th largest key, signed order
    greater = tl.load(gt_ptr + row * num_chunks + c, mask=c_ok, other=0) \
        + tl.sum(tl.where(b[None, :] > digit, per_chunk, 0), 1)
    equal = tl.sum(tl.where(b[None, :] == digit, per_chunk, 0), 1)
    earlier = c < chunk
    equal_before = tl.sum(tl.where(earlier, equal, 0), 0)
    start = tl.sum(tl.where(earlier, greater, 0), 0) + tl.minimum(equal_before, take_equal)

    i = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = i < n
    key = _ordered(tl.load(scores_ptr + row.to(tl.int64) * stride_s + i, mask=ok, other=0.0))
    is_equal = (ok & (key == threshold)).to(tl.int32)
    equal_rank = equal_before + tl.cumsum(is_equal, 0) - is_equal  # ties: the lowest indices first
    win = (ok & (key > threshold)) | ((is_equal != 0) & (equal_rank < take_equal))
    wins = win.to(tl.int32)
    place = start + tl.cumsum(wins, 0) - wins
    tl.store(out_ptr + row.to(tl.int64) * stride_o + place, i.to(tl.int64), mask=win)


def _warps(chunk: int) -> int:
    return 16 if chunk >= 16384 else 8 if chunk >= 4096 else 4


def top_k_ascending(scores: torch.Tensor, k: int, chunk: int = CHUNK, write_chunk: int | None = None) -> torch.Tensor:
    """scores [..., n] fp32 (no NaN), 1 <= k <= n -> int64 [..., k]: the indices of the k largest
    scores of each row in ascending order; among equal scores at the threshold the lowest.
    chunk: scores per program of the counting rounds; write_chunk: of the last round and the write."""
    write_chunk = write_chunk or WRITE_CHUNK
    *lead, n = scores.shape
    assert scores.dtype == torch.float32 and 1 <= k <= n < 2**31, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    out = torch.empty(R, k, dtype=torch.int64, device=scores.device)
    if R == 0:
        return out.view(*lead, k)
    num_chunks = triton.cdiv(n, write_chunk)  # the last round's, for the write
    hist = torch.zeros((ROUNDS - 1) * R * 16, dtype=torch.int32, device=scores.device)
    chunk_hist = torch.empty(R * num_chunks * 16, dtype=torch.int32, device=scores.device)
    greater = torch.empty(R * num_chunks, dtype=torch.int32, device=scores.device)
    for r in range(ROUNDS):
        size = chunk if r < ROUNDS - 1 else write_chunk
        _radix_round[(R, triton.cdiv(n, size))](rows, hist, greater, chunk_hist, n, R, k, rows.stride(0), num_chunks,
                                                ROUND=r, CHUNK=size, num_warps=_warps(size))
    _radix_write[(R, num_chunks)](rows, hist, greater, chunk_hist, out, n, R, k, rows.stride(0), out.stride(0),
                                  num_chunks, CHUNK=write_chunk, BLOCK_C=max(2, triton.next_power_of_2(num_chunks)),
                                  num_warps=_warps(write_chunk))
    return out.view(*lead, k)
