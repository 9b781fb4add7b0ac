"""Write a step's K and V, as the decoder makes them ([B, T, heads, D] views of the projection), into
one layer's pages in one launch (CUDA).

The torch path first copies each of K and V into (sequence, head, token) row order, since the slots
come in that order, then scatters the rows with index_copy_: four kernels and two temporary copies
per layer. Here each program reads a tile of one (sequence, head)'s tokens
straight from the strided views and stores K and V at their slots.

Bit for bit the torch path: the values are copied, converted to the store's dtype if they differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.model.triton import pdl


@triton.jit(do_not_specialize=["T"])  # the chunk length changes from call to call
def _write_heads(k_ptr, v_ptr, slots_ptr, k_dst, v_dst, T, H,
                 sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, GDC: tl.constexpr,
                 EARLY: tl.constexpr):
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    bh = tl.program_id(0).to(tl.int64)  # sequence * H + head: the slots' row order
    b, h = bh // H, bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    ok = t_ok[:, None] & (d < D)[None, :]
    slot = tl.load(slots_ptr + bh * T + t, mask=t_ok, other=0).to(tl.int64)
    dst = slot[:, None] * D + d[None, :]
    k = tl.load(k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :], mask=ok)
    tl.store(k_dst + dst, k.to(k_dst.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + t[:, None] * sv_t + d[None, :], mask=ok)
    tl.store(v_dst + dst, v.to(v_dst.dtype.element_ty), mask=ok)


def write_heads(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_store: torch.Tensor,
                v_store: torch.Tensor) -> None:
    """k, v [B, T, H, D] (unit stride along D) into one layer's stores [pages, page_size, D] at flat
    slots [B * H * T] in (sequence, head, token) order."""
    B, T, H, D = k.shape
    if B * T * H == 0:
        return
    assert k.stride(3) == 1 and v.stride(3) == 1 and k_store.is_contiguous() and v_store.is_contiguous()
    assert slots.numel() == B * H * T
    block_t = min(64, triton.next_power_of_2(T))
    _write_heads[(B * H, triton.cdiv(T, block_t))](
        k, v, slots, k_store, v_store, T, H,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=block_t, num_warps=4 if block_t >= 32 else 1,
        **pdl.launch_options(k.device, early=True),
    )
