"""Rotate-half RoPE applied in place to the q and k heads of the fused q/k/v projection's output.

The torch path (apply_rope) builds the rotated copy with a negation, a concatenation, a multiply and
an addcmul: four launches and a new [B, T, Hq + Hkv, D] tensor. Here one program rotates a block of
heads of one token where they lie, reading the token's cos/sin rows (which the model computes in
fp64 and rounds to its dtype) once for all of them. Arithmetic is fp32, rounded once.

`rope_store` is the graphed decode step's version (engine/cuda_graphs.py): the same rotation, and in
the same launch the step's stores that would otherwise be two more kernels per layer, the rotated q
into the step's query buffer and the rotated k with v at the token's slots of the KV pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.model.triton import pdl


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, heads, ok_heads, b, t, stride_xb, stride_xt, stride_xh, stride_cb, stride_ct,
            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate heads `heads` (a [BLOCK_H] vector) of token (b, t) in place -> the two rotated halves,
    rounded to x's dtype, [BLOCK_H, BLOCK_HALF] each, with their mask."""
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    ok = ok_heads[:, None] & d_ok[None, :]
    cs = b * stride_cb + t * stride_ct + d
    cos1 = tl.load(cos_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + b * stride_xb + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    y1 = (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty)
    tl.store(first, y1, mask=ok)
    tl.store(first + HALF, y2, mask=ok)
    return y1, y2, ok


@triton.jit
def _rope_in_place(
    x_ptr, cos_ptr, sin_ptr, num_heads,
    stride_xb, stride_xt, stride_xh, stride_cb, stride_ct,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr,
):
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    _rotate(x_ptr, cos_ptr, sin_ptr, heads, heads < num_heads, b, t, stride_xb, stride_xt, stride_xh,
            stride_cb, stride_ct, HALF, BLOCK_HALF)


@triton.jit
def _rope_store(
    x_ptr, cos_ptr, sin_ptr, q_out_ptr, slots_ptr, k_dst, v_dst, HQ, HKV,
    stride_xb, stride_xh, stride_cb, stride_qb, stride_qh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr,
):
    """One program per block of heads of one sequence's token: q heads rotate (in place and into
    q_out), k heads rotate (in place and to their slot in k_dst), v heads copy to their slot in v_dst.
    A block holds heads of one kind only: the launcher cuts the blocks at HQ and HQ + HKV."""
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    q_blocks = tl.cdiv(HQ, BLOCK_H)
    kv_blocks = tl.cdiv(HKV, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        y1, y2, ok = _rotate(x_ptr, cos_ptr, sin_ptr, heads, heads < HQ, b, 0, stride_xb, 0, stride_xh,
                             stride_cb, 0, HALF, BLOCK_HALF)
        out = q_out_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
        tl.store(out, y1.to(q_out_ptr.dtype.element_ty), mask=ok)
        tl.store(out + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=ok)
    else:
        kv_head = (block - q_blocks) % kv_blocks * BLOCK_H + tl.arange(0, BLOCK_H)
        ok_heads = kv_head < HKV
        slot = tl.load(slots_ptr + b * HKV + kv_head, mask=ok_heads, other=0).to(tl.int64)
        dst = slot[:, None] * (2 * HALF) + d[None, :]
        if block < q_blocks + kv_blocks:
            y1, y2, ok = _rotate(x_ptr, cos_ptr, sin_ptr, HQ + kv_head, ok_heads, b, 0, stride_xb, 0, stride_xh,
                                 stride_cb, 0, HALF, BLOCK_HALF)
            tl.store(k_dst + dst, y1.to(k_dst.dtype.element_ty), mask=ok)
            tl.store(k_dst + dst + HALF, y2.to(k_dst.dtype.element_ty), mask=ok)
        else:
            ok = ok_heads[:, None] & (d < HALF)[None, :]
            src = x_ptr + b * stride_xb + (HQ + HKV + kv_head)[:, None] * stride_xh + d[None, :]
            v1 = tl.load(src, mask=ok)
            v2 = tl.load(src + HALF, mask=ok)
            tl.store(v_dst + dst, v1.to(v_dst.dtype.element_ty), mask=ok)
            tl.store(v_dst + dst + HALF, v2.to(v_dst.dtype.element_ty), mask=ok)


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


def rope_store(qkv: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
               slots: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, block_h: int = 4,
               num_warps: int = 1) -> torch.Tensor:
    """A decode step's RoPE and stores: qkv [B, 1, Hq + 2 Hkv, D] has its q and k heads rotated in
    place (as rope_in_place), the rotated q also goes into q_out [B, Hq, D], and the rotated k and v
    into one layer's stores [pages, page_size, D] at slots [B * Hkv] (in (sequence, head) order,
    as pool.write_heads takes them), converted to the stores' dtype. Returns qkv[:, :, :Hq + Hkv]."""
    B, T, H, D = qkv.shape
    Hkv = (H - num_q_heads) // 2
    assert T == 1 and num_q_heads + 2 * Hkv == H and D % 2 == 0 and slots.numel() == B * Hkv
    assert qkv.stride(3) == 1 and cos.stride(3) == 1 and cos.stride() == sin.stride() and cos.shape[1] == 1
    assert cos.shape[0] in (1, B) and q_out.shape == (B, num_q_heads, D) and q_out.stride(2) == 1
    assert k_store.is_contiguous() and v_store.is_contiguous() and k_store.shape[-1] == D and slots.is_contiguous()
    blocks = triton.cdiv(num_q_heads, block_h) + 2 * triton.cdiv(Hkv, block_h)
    _rope_store[(blocks, B)](
        qkv, cos, sin, q_out, slots, k_store, v_store, num_q_heads, Hkv,
        qkv.stride(0), qkv.stride(2), cos.stride(0) if cos.shape[0] == B else 0, q_out.stride(0), q_out.stride(1),
        HALF=D // 2, BLOCK_HALF=triton.next_power_of_2(D // 2), BLOCK_H=block_h, num_warps=num_warps,
        **pdl.launch_options(qkv.device, early=True),
    )
    return qkv[:, :, : num_q_heads + Hkv]
