"""Planted kernels for the test of the sm_90 compile check itself: the same kernel written twice, once
with a `tl.constexpr` assigned inside a `tl.static_range` loop (the compiler unrolls the loop and
rejects the second assignment: a constexpr cannot be reassigned; Triton's interpreter runs it) and
once correctly. Both compute, per element, the sum of the low two 4-bit digits of x."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

N = 64


@triton.jit
def constexpr_reassigned(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    acc = tl.zeros([N], tl.int32)
    for r in tl.static_range(2):
        SHIFT: tl.constexpr = 4 * r
        acc += (x >> SHIFT) & 15
    tl.store(out_ptr + i, acc)


@triton.jit
def constexpr_once(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    acc = tl.zeros([N], tl.int32)
    for r in tl.static_range(2):
        shift = 4 * r  # a compile-time int: r is the unrolled loop's
        acc += (x >> shift) & 15
    tl.store(out_ptr + i, acc)


def launch(kernel, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel[(1,)](x, out, N=N)
    return out


CASES = {
    "planted/constexpr_reassigned": lambda: launch(constexpr_reassigned, torch.zeros(N, dtype=torch.int32)),
    "planted/constexpr_once": lambda: launch(constexpr_once, torch.zeros(N, dtype=torch.int32)),
}
