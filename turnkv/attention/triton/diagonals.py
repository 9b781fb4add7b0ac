"""Diagonal (slash-line) sums and maxima of LoopServe's sampled attention rows, read in place
(turnkv.attention.lines.diagonal_sums is the reference and the CPU path).

weights [N, R, S]: R sampled rows per unit, over key entries that sit at their positions (entry c is
position c). Row r at position p has diagonal offset d at entry p - d, so the offsets of a block read
a contiguous, reversed range of each row. One program = one (unit, block of BLOCK offsets): it walks
the R rows in order, adding each row's entries (0 where the entry is outside [0, S)) and keeping the
largest, and writes both once. The sums are added row by row from zero, in the reference's order, so
they equal it bitwise (contraction off); the maxima are exact. Every weight is read once, with no
atomics and no [N, R, S] index tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _diagonals(w_ptr, pos_ptr, sum_ptr, max_ptr, R, S, O, U, stride_wn, stride_wr,
               BLOCK: tl.constexpr):
    pid_d = tl.program_id(0)
    n = tl.program_id(1)
    b = n // U
    d = pid_d * BLOCK + tl.arange(0, BLOCK)
    d_ok = d < O
    w_row = w_ptr + n.to(tl.int64) * stride_wn
    total = tl.zeros([BLOCK], tl.float32)
    top = tl.zeros([BLOCK], tl.float32)
    for r in range(0, R):
        p = tl.load(pos_ptr + b * R + r)
        c = p - d
        ok = d_ok & (c >= 0) & (c < S)
        w = tl.load(w_row + r * stride_wr + c, mask=ok, other=0.0)
        total = total + w
        top = tl.maximum(top, w, propagate_nan=tl.PropagateNan.ALL)  # as torch.maximum
    tl.store(sum_ptr + n.to(tl.int64) * O + d, total, mask=d_ok)
    tl.store(max_ptr + n.to(tl.int64) * O + d, top, mask=d_ok)


def diagonal_sums(weights: torch.Tensor, row_positions: list[list[int]], num_offsets: int):
    """weights [N, R, S] fp32 (last dim contiguous), row_positions [B][R] on the host (N = B * units)
    -> (w_s, s_max) [N, num_offsets] fp32."""
    N, R, S = weights.shape
    assert weights.dtype == torch.float32 and weights.stride(2) == 1
    B = len(row_positions)
    total = torch.empty(N, num_offsets, dtype=torch.float32, device=weights.device)
    top = torch.empty_like(total)
    if N and num_offsets:
        # From pageable memory a non-blocking copy is staged at once and waits for no GPU work.
        pos = torch.tensor(row_positions, dtype=torch.int32).to(weights.device, non_blocking=True)
        grid = (triton.cdiv(num_offsets, BLOCK), N)
        _diagonals[grid](weights, pos, total, top, R, S, num_offsets, N // B, weights.stride(0), weights.stride(1),
                         BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return total, top
