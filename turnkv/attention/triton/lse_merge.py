"""Two attention results over disjoint key sets merged by their log-sum-exp, in one pass: for each row,
out = a * exp(lse_a - lse) + b * exp(lse_b - lse) with lse = logaddexp(lse_a, lse_b). attention/chunk.py
split_history merges a chunk's attention over its history with its attention over itself this way.
Torch reference: chunk._merge_reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge(a_ptr, b_ptr, la_ptr, lb_ptr, out_ptr, rows, T, Hq,
           sa_b, sa_h, sa_t, sb_b, sb_h, sb_t, so_b, so_h, so_t,
           D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # rows in (b, h, t) order
    d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    mask = r_ok[:, None] & (d < D)[None, :]
    t = r % T
    h = (r // T) % Hq
    b = r // (T * Hq)
    la = tl.load(la_ptr + r, mask=r_ok, other=0.0)
    lb = tl.load(lb_ptr + r, mask=r_ok, other=0.0)
    top = tl.maximum(la, lb)
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    total = wa + wb
    a = tl.load(a_ptr + (b * sa_b + h * sa_h + t * sa_t)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + (b * sb_b + h * sb_h + t * sb_t)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (a * (wa / total)[:, None] + bb * (wb / total)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (b * so_b + h * so_h + t * so_t)[:, None] + d[None, :], out, mask=mask)


def merge(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """a, b [B, Hq, T, D] (any strides, the last dimension contiguous); lse_a, lse_b [B, Hq, T] fp32,
    contiguous -> out [B, Hq, T, D] in a's dtype (into `out`, any strides with a contiguous last
    dimension: a [B, T, Hq, D] buffer seen as [B, Hq, T, D] spares the caller a transpose)."""
    B, Hq, T, D = a.shape
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and lse_a.is_contiguous() and lse_b.is_contiguous()
    out = torch.empty_like(a) if out is None else out
    assert out.shape == a.shape and out.stride(-1) == 1
    rows = B * Hq * T
    BLOCK_R = 16
    _merge[(triton.cdiv(rows, BLOCK_R),)](
        a, b, lse_a, lse_b, out, rows, T, Hq,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        D=D, BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )
    return out
