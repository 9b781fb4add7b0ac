"""Rotate-half RoPE applied in place to the q and k heads of the fused q/k/v projection's output.

The torch path (apply_rope) builds the rotated copy with a negation, a concatenation, a multiply and
an addcmul: four launches and a new [B, T, Hq + Hkv, D] tensor. Here one program rotates a block of
heads of one token where they lie, reading the token's cos/sin rows (which the model computes in
fp64 and rounds to its dtype) once for all of them. Arithmetic is fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from turnkv.model.triton import pdl


@triton.jit
def _rope_in_place(
    x_ptr, cos_ptr, sin_ptr, num_heads,
    stride_xb, stride_xt, stride_xh, stride_cb, stride_ct,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr,
):
    if GDC:  # PDL: the previous kernel's writes first, then let the next one launch (model/triton/pdl.py)
        gdc_wait()
        if EARLY:
            gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    ok = (heads < num_heads)[:, None] & d_ok[None, :]
    cs = b * stride_cb + t * stride_ct + d
    cos1 = tl.load(cos_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + b * stride_xb + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    tl.store(first, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=ok)


def rope_in_place(x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  block_h: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Rotate heads [0, num_heads) of x [B, T, H, D] in place; cos/sin [B or 1, T, 1, D] (same
    strides). Returns x[:, :, :num_heads]."""
    B, T, H, D = x.shape
    assert x.stride(3) == 1 and cos.stride(3) == 1 and cos.stride() == sin.stride() and D % 2 == 0
    assert cos.shape[1] == T and cos.shape[0] in (1, B) and num_heads <= H
    half = D // 2
    block_h = block_h or min(triton.next_power_of_2(num_heads), 8)
    _rope_in_place[(T, triton.cdiv(num_heads, block_h), B)](
        x, cos, sin, num_heads, x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0) if cos.shape[0] == B else 0, cos.stride(1),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=num_warps,
        **pdl.launch_options(x.device, early=True),
    )
    return x[:, :, :num_heads]
