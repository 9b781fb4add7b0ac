"""Quantize K/V rows and write them into a quantized page pool in one launch (CUDA).

The torch path (quant.quantize, then index_copy_ of codes and scales) is about ten small kernels per
tensor; a decode step of a 32-layer model runs it 64 times, and at batch 1 those launches are a
visible share of the step. Here one program per row computes the row's scale, its codes and
stores both at the row's slot, for K and V together.

The arithmetic is quant.quantize's, step for step, so both paths give the same codes and scales:
the scale as max |x| times 1 / qmax, the codes by IEEE division (div_rn), round-half-even for int8 by the 1.5 * 2**23 addition (exact for |y| < 2**22),
round-half-even onto e4m3's grid for fp8 (values already clamped to +-448), as torch's casts round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.kv import quant


@triton.jit
def _quantize_row(x_ptr, dst_ptr, scale_ptr, slot, d, d_ok, QMAX: tl.constexpr, QINV: tl.constexpr,
                  FP8: tl.constexpr, D: tl.constexpr):
    x = tl.load(x_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) * QINV
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -QMAX), QMAX)
    if FP8:
        # Rounded to e4m3's grid here, by bit arithmetic, so the conversion below is exact: Triton's
        # interpreter rounds a carry into the next binade wrongly (125.2 -> 64), and exact values
        # leave nothing to the conversion's rounding mode. Normals keep 3 mantissa bits (round half
        # to even on bit 20); below 2**-6, subnormals are multiples of 2**-9.
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000
        a = mag.to(tl.float32, bitcast=True)
        sub = (((a * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.float32)
               * 0.001953125).to(tl.int32, bitcast=True)
        r = tl.where(a < 0.015625, sub, normal) | (bits & -2147483648)  # the sign bit back
        codes = r.to(tl.float32, bitcast=True).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        # + 1.5 * 2**23 rounds to an integer, which then sits in the low mantissa bits of 0x4B400000.
        codes = ((y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)
    tl.store(dst_ptr + slot * D + d, codes, mask=d_ok)
    tl.store(scale_ptr + slot, scale)


@triton.jit
def _quantize_write(k_ptr, v_ptr, slots_ptr, k_dst, v_dst, k_scale, v_scale, stride_k, stride_v,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, QINV: tl.constexpr,
                    FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    _quantize_row(k_ptr + row * stride_k, k_dst, k_scale, slot, d, d_ok, QMAX, QINV, FP8, D)
    _quantize_row(v_ptr + row * stride_v, v_dst, v_scale, slot, d, d_ok, QMAX, QINV, FP8, D)


def quantize_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_store: torch.Tensor,
                   v_store: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Rows k, v [n, D] (compute dtype, unit column stride) quantized into one layer's stores
    ([pages, page_size, D] codes, [pages, page_size] fp32 scales) at flat slots [n]."""
    n, D = k.shape
    if n == 0:
        return
    assert k.stride(1) == 1 and v.stride(1) == 1 and k_store.is_contiguous() and v_store.is_contiguous()
    dtype = k_store.dtype
    _quantize_write[(n,)](
        k, v, slots, quant.raw(k_store), quant.raw(v_store), k_scale, v_scale, k.stride(0), v.stride(0),
        D=D, BLOCK_D=triton.next_power_of_2(D), QMAX=quant.QMAX[dtype], QINV=1.0 / quant.QMAX[dtype],
        FP8=dtype == quant.FP8,
        num_warps=1 if D <= 128 else 2,
    )
