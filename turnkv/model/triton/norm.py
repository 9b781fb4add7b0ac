"""Residual add fused into the RMSNorm that follows it: residual += x; out = rmsnorm(residual) * w.

The decoder's residual stream meets a norm twice per layer; done apart, the add writes the sum and
the norm reads it back (two launches, three passes over the row). Here one program per row reads x
and the residual once, writes the new residual and the normalised row, in fp32 arithmetic.
The residual is rounded to its dtype before the norm reads it, as the separate add would round it,
so the stream carried to the next layer is the one the norm saw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.model.triton import pdl

# Rows up to this width sit in registers in one tile (Llama-70B's 8192 included); wider rows loop.
MAX_TILE = 8192


@triton.jit
def _add_rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, H, eps,
    BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr,
):
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    if ONE_TILE:
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        s = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
        s = s.to(res_ptr.dtype.element_ty)
        tl.store(r_row + cols, s, mask=ok)
        s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, 0) / H + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        squares = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, H, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < H
            s = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
            s = s.to(res_ptr.dtype.element_ty)
            tl.store(r_row + cols, s, mask=ok)
            s = s.to(tl.float32)
            squares += s * s
        rstd = tl.rsqrt(tl.sum(squares, 0) / H + eps)
        tl.debug_barrier()  # the second pass may read columns another thread of the program wrote
        for c0 in range(0, H, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < H
            s = tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_row + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x, residual: [R, H] with contiguous rows (residual is updated in place); weight [H].
    Returns rmsnorm(residual + x) * weight in x's dtype (into `out` when given)."""
    R, H = x.shape
    assert residual.shape == (R, H) and x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x) if out is None else out
    block = block or min(triton.next_power_of_2(H), MAX_TILE)
    # Enough threads that each holds 8-16 elements of the row; more warps only add reduction steps.
    num_warps = num_warps or max(1, min(16, block // 512))
    _add_rms_norm[(R,)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), H, eps,
                        BLOCK=block, ONE_TILE=block >= H, num_warps=num_warps,
                        **pdl.launch_options(x.device, early=True))
    return out
