"""Exact top-k of long fp32 score rows on the GPU by radix select, the winners written in ascending
index order: LoopServe's re-selection (a row per query head of every history token, k = 1024 of 128K).

Contract as top_k.py's short-row kernel and a stable descending sort: ties at the threshold go to the
lowest indices; scores must not be NaN. Many equal scores (a row mostly -inf) cost time, not
correctness. Five passes over the scores: three counting rounds, a compaction of the candidates,
and the write, which places the winners in order with no sort.
Design: docs/kernels.md#top-k-of-long-rows-radix-select"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.attention.triton.top_k import _ordered

# Scores per program of the counting rounds, and of the compaction and the write (whose counts are
# per chunk): the fastest pair on an H100 at 32 rows x 128K.
CHUNK = 8192
WRITE_CHUNK = 2048
COUNT_ROUNDS = 3  # 4-bit digits found over every key before the compaction
BLOCK = 2048  # candidates a step of the per-row program
SIGN: tl.constexpr = tl.constexpr(-2147483648)  # int32 with only the sign bit


@triton.jit
def _pick(h, need):
    """One digit from its 16-bin histogram h of the keys still in the running: -> (the digit of the
    need-th largest of them, how many keys with that digit are still to take)."""
    b = tl.arange(0, 16)
    above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in the higher digits
    digit = tl.max(tl.where((above < need) & (above + h >= need), b, -1), 0)
    return digit, need - tl.sum(tl.where(b == digit, above, 0), 0)


@triton.jit
def _descend(hist_ptr, row, R, K, ROUNDS_DONE: tl.constexpr):
    """Walk a row's first ROUNDS_DONE digit histograms from the top: -> (the digits of the k-th
    largest key found so far, high bits first, as an unsigned-order int32; how many of the keys
    that match them are still to take)."""
    b = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.int32)
    need = K
    for r in tl.static_range(ROUNDS_DONE):
        digit, need = _pick(tl.load(hist_ptr + (r * R + row) * 16 + b), need)
        prefix = prefix | (digit << (28 - 4 * r))
    return prefix, need


@triton.jit(do_not_specialize=["n", "R"])  # row counts and widths change from call to call
def _radix_round(scores_ptr, hist_ptr, n, R, K, stride_s, ROUND: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = i < n
    x = tl.load(scores_ptr + row.to(tl.int64) * stride_s + i, mask=ok, other=0.0)
    ukey = _ordered(x) ^ SIGN  # unsigned order: digits read from the top bit down
    prefix, need = _descend(hist_ptr, row, R, K, ROUND)
    SHIFT: tl.constexpr = 28 - 4 * ROUND
    if ROUND > 0:  # the keys whose higher digits are the k-th largest's
        ok = ok & ((ukey >> (SHIFT + 4)) == (prefix >> (SHIFT + 4)))
    counts = tl.histogram((ukey >> SHIFT) & 15, 16, mask=ok)
    tl.atomic_add(hist_ptr + (ROUND * R + row) * 16 + tl.arange(0, 16), counts)


@triton.jit(do_not_specialize=["n", "R", "num_chunks"])  # row counts and widths change from call to call
def _compact(scores_ptr, hist_ptr, count_ptr, cand_ptr, above_ptr, n, R, K, stride_s, num_chunks,
             ROUNDS_DONE: tl.constexpr, CHUNK: tl.constexpr):
    """Append the chunk's keys that share the k-th largest's found digits to the row's candidates
    (key, index), and store how many of its keys are above them."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = i < n
    key = _ordered(tl.load(scores_ptr + row.to(tl.int64) * stride_s + i, mask=ok, other=0.0))
    prefix, need = _descend(hist_ptr, row, R, K, ROUNDS_DONE)
    SHIFT: tl.constexpr = 32 - 4 * ROUNDS_DONE
    # Signed keys: an arithmetic shift keeps their order.
    high, found = key >> SHIFT, (prefix ^ SIGN) >> SHIFT
    tl.store(above_ptr + row * num_chunks + chunk, tl.sum((ok & (high > found)).to(tl.int32), 0))
    match = (ok & (high == found)).to(tl.int32)
    base = tl.atomic_add(count_ptr + row, tl.sum(match, 0))
    place = row.to(tl.int64) * n + base + tl.cumsum(match, 0) - match
    tl.store(cand_ptr + 2 * place, key, mask=match != 0)
    tl.store(cand_ptr + 2 * place + 1, i, mask=match != 0)


@triton.jit(do_not_specialize=["n", "R", "num_chunks"])  # row counts and widths change from call to call
def _finish(cand_ptr, count_ptr, hist_ptr, greater_ptr, equal_ptr, threshold_ptr, n, R, K, num_chunks,
            ROUNDS_DONE: tl.constexpr, WRITE_CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the lower digits over the candidates, then per write chunk the
    candidates above the k-th largest key and those equal to it; stores the key and how many of the
    equal ones win."""
    row = tl.program_id(0)
    prefix, need = _descend(hist_ptr, row, R, K, ROUNDS_DONE)
    count = tl.load(count_ptr + row)
    cand = cand_ptr + row.to(tl.int64) * n * 2
    j0 = tl.arange(0, BLOCK)
    for r in tl.static_range(ROUNDS_DONE, 8):
        shift = 28 - 4 * r  # a compile-time int (r is the static loop's)
        h = tl.zeros([16], tl.int32)
        for start in range(0, count, BLOCK):
            j = start + j0
            ukey = tl.load(cand + 2 * j, mask=j < count, other=0) ^ SIGN
            ok = (j < count) & ((ukey >> (shift + 4)) == (prefix >> (shift + 4)))
            h += tl.histogram((ukey >> shift) & 15, 16, mask=ok)
        digit, need = _pick(h, need)
        prefix = prefix | (digit << shift)
    threshold = prefix ^ SIGN  # the k-th largest key, signed order
    one = tl.full([BLOCK], 1, tl.int32)
    for start in range(0, count, BLOCK):
        j = start + j0
        key = tl.load(cand + 2 * j, mask=j < count, other=0)
        at = row * num_chunks + tl.load(cand + 2 * j + 1, mask=j < count, other=0) // WRITE_CHUNK
        tl.atomic_add(greater_ptr + at, one, mask=(j < count) & (key > threshold))
        tl.atomic_add(equal_ptr + at, one, mask=(j < count) & (key == threshold))
    tl.store(threshold_ptr + 2 * row, threshold)
    tl.store(threshold_ptr + 2 * row + 1, need)


@triton.jit(do_not_specialize=["n", "num_chunks"])  # row counts and widths change from call to call
def _radix_write(scores_ptr, above_ptr, greater_ptr, equal_ptr, threshold_ptr, out_ptr, n, stride_s, stride_o,
                 num_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    threshold = tl.load(threshold_ptr + 2 * row)
    take_equal = tl.load(threshold_ptr + 2 * row + 1)  # winners equal to the threshold
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_chunks
    at = row * num_chunks + c
    greater = tl.load(above_ptr + at, mask=c_ok, other=0) + tl.load(greater_ptr + at, mask=c_ok, other=0)
    equal = tl.load(equal_ptr + at, mask=c_ok, other=0)
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
    chunk: scores per program of the counting rounds; write_chunk: of the compaction and the write."""
    write_chunk = write_chunk or WRITE_CHUNK
    *lead, n = scores.shape
    assert scores.dtype == torch.float32 and 1 <= k <= n < 2**30, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    out = torch.empty(R, k, dtype=torch.int64, device=scores.device)
    if R == 0:
        return out.view(*lead, k)
    nc = triton.cdiv(n, write_chunk)
    dev = scores.device
    # One zeroed buffer (one launch): the rounds' histograms, the candidate counts, and per write
    # chunk the candidates above and equal to the threshold.
    zeroed = torch.zeros(COUNT_ROUNDS * R * 16 + R + 2 * R * nc, dtype=torch.int32, device=dev)
    hist, count, greater, equal = zeroed.split([COUNT_ROUNDS * R * 16, R, R * nc, R * nc])
    above = torch.empty(R * nc, dtype=torch.int32, device=dev)
    candidates = torch.empty(R * n * 2, dtype=torch.int32, device=dev)  # (key, index) pairs, room for a row
    threshold = torch.empty(R * 2, dtype=torch.int32, device=dev)
    for r in range(COUNT_ROUNDS):
        _radix_round[(R, triton.cdiv(n, chunk))](rows, hist, n, R, k, rows.stride(0), ROUND=r, CHUNK=chunk,
                                                 num_warps=_warps(chunk))
    _compact[(R, nc)](rows, hist, count, candidates, above, n, R, k, rows.stride(0), nc, ROUNDS_DONE=COUNT_ROUNDS,
                      CHUNK=write_chunk, num_warps=_warps(write_chunk))
    _finish[(R,)](candidates, count, hist, greater, equal, threshold, n, R, k, nc, ROUNDS_DONE=COUNT_ROUNDS,
                  WRITE_CHUNK=write_chunk, BLOCK=BLOCK, num_warps=8)
    _radix_write[(R, nc)](rows, above, greater, equal, threshold, out, n, rows.stride(0), out.stride(0), nc,
                          CHUNK=write_chunk, BLOCK_C=max(2, triton.next_power_of_2(nc)), num_warps=_warps(write_chunk))
    return out.view(*lead, k)
