"""Fold a step's keys (a prefill chunk's, an eager decode step's) into the per-logical-page key
min/max (Quest / LServe's page summaries, turnkv/methods/lserve/summaries.py), reading the keys in
place from the step's K.

`fold_runs` takes runs of consecutive tokens: run r is one (sequence, KV head) that wrote T tokens
at slots [T] (slot = pool page * page_size + offset), in order. One program per (segment, run),
where a segment is the run's tokens inside one logical page: it reduces their keys to a max and a
min per channel and writes the logical page's row, replacing it when the segment holds the page's
first token (slot % logical_page == 0), else folding into what the row holds (the page was begun
by an earlier step). Every row is written by one program: no atomics, no order between programs.

Bit for bit PageSummaries.update over the same slots and keys: max and min are exact, taken in the
statistics' dtype after converting the keys to it, as update does (k.to(kmax.dtype)), and a NaN
key makes its channel's max and min NaN, as scatter_reduce's amax / amin do. Keys come in
that dtype or a narrower one fp32 holds exactly (`takes`): a narrowing conversion would round, and
Triton's interpreter rounds differently from torch. The torch reference is PageSummaries.update_runs'
path off the kernel's devices."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=["T", "NH"])  # chunk lengths and head counts change from call to call
def _fold_runs(k_ptr, slots_ptr, heads_ptr, kmax_ptr, kmin_ptr, T, NH,
               sk_b, sk_t, sk_h, sk_d, ss_b, ss_h, ss_t,
               D: tl.constexpr, BLOCK_D: tl.constexpr, LOGICAL: tl.constexpr, BLOCK_L: tl.constexpr,
               ALL_HEADS: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1).to(tl.int64)  # sequence * NH + the index of its head in `heads`
    b = run // NH
    if ALL_HEADS:
        h = run % NH
    else:
        h = tl.load(heads_ptr + run % NH).to(tl.int64)
    run_slots = slots_ptr + b * ss_b + h * ss_h
    # Token t sits at offset (lead + t) % LOGICAL of its logical page: segment `seg` holds the
    # run's tokens [t0, t1), empty past the run's end.
    lead = tl.load(run_slots).to(tl.int64) % LOGICAL
    t0 = tl.maximum(seg * LOGICAL - lead, 0)
    t1 = tl.minimum((seg + 1) * LOGICAL - lead, T)
    live = t0 < t1
    slot = tl.load(run_slots + t0 * ss_t, mask=live, other=0).to(tl.int64)
    reset = (slot % LOGICAL) == 0  # the segment begins its logical page
    t = t0 + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    ok = (t < t1)[:, None] & d_ok[None, :]
    stat = kmax_ptr.dtype.element_ty
    keys = tl.load(k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :] * sk_d, mask=ok)
    # Held in fp32, which holds the keys' and the statistics' values exactly (and needs no 16-bit
    # constant, which Triton's interpreter lacks); the results convert back exactly.
    keys = keys.to(tl.float32)
    # tl.max / tl.min drop NaNs on the GPU: a channel with a NaN key is made NaN after them.
    nan = tl.max((ok & (keys != keys)).to(tl.int32), axis=0) != 0
    seg_max = tl.where(nan, float("nan"), tl.max(tl.where(ok, keys, float("-inf")), axis=0))
    seg_min = tl.where(nan, float("nan"), tl.min(tl.where(ok, keys, float("inf")), axis=0))
    row = (slot // LOGICAL) * D + d
    write = d_ok & live
    # A page the segment begins drops what its row held.
    old_max = tl.load(kmax_ptr + row, mask=write & ~reset).to(tl.float32)
    old_min = tl.load(kmin_ptr + row, mask=write & ~reset).to(tl.float32)
    old_max = tl.where(reset, float("-inf"), old_max)
    old_min = tl.where(reset, float("inf"), old_min)
    tl.store(kmax_ptr + row, _max(old_max, seg_max).to(stat), mask=write)
    tl.store(kmin_ptr + row, _min(old_min, seg_min).to(stat), mask=write)


def takes(keys: torch.dtype, stats: torch.dtype) -> bool:
    """Whether keys of dtype `keys` fold into statistics of dtype `stats` here: the same dtype, or
    bf16 / fp16 into fp32 (exact conversions)."""
    return keys == stats or (stats == torch.float32 and keys in (torch.bfloat16, torch.float16))


def fold_runs(k: torch.Tensor, slots: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, logical_page: int,
              heads: torch.Tensor | None = None) -> None:
    """k [B, T, H, D] the keys of a step (any strides); slots [B, H, T] the flat slots each
    (sequence, head) wrote its T tokens at, in token order; kmax / kmin one layer's statistics
    [rows, D] (row = slot // logical_page), contiguous, updated in place; heads [n] int tensor on
    k's device: the KV heads folded (None: all H), the runs being (b, heads[j]).

    Each run's slots fill its pages in order: token t's offset in its logical page is
    (slots[b, h, 0] + t) % logical_page, and the tokens of one logical page are one segment. No
    two runs share a logical page."""
    B, T, H, D = k.shape
    NH = H if heads is None else heads.numel()
    if B * T * NH == 0:
        return
    assert slots.shape == (B, H, T) and kmax.is_contiguous() and kmin.is_contiguous() and kmax.shape[-1] == D
    assert kmax.dtype == kmin.dtype and takes(k.dtype, kmax.dtype) and (heads is None or heads.device == k.device)
    block_l = triton.next_power_of_2(logical_page)
    block_d = triton.next_power_of_2(D)
    segments = triton.cdiv(T + logical_page - 1, logical_page)  # at most, whatever the runs' first offset
    _fold_runs[(segments, B * NH)](
        k, slots, slots if heads is None else heads, kmax, kmin, T, NH,
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), slots.stride(0), slots.stride(1), slots.stride(2),
        D=D, BLOCK_D=block_d, LOGICAL=logical_page, BLOCK_L=block_l, ALL_HEADS=heads is None,
        num_warps=4 if block_l * block_d >= 2048 else 2,
    )
