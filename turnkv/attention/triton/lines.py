"""Vertical + slash line prefill attention (LoopServe, MInference, A-/Tri-shape, LServe streaming heads).

Each new row attends exactly to the union of its unit's selected key columns (vertical lines) and
diagonals (slash lines), every cell counted once, with an online softmax in fp32. Layout required
(turnkv.attention.lines.kernel_layout checks it; others take the reference path): key entry c of every
head is at absolute position c, valid entries are a prefix [0, kv_len), and row t of sequence b is at
position q0[b] + t. Lines belong to a unit: the query head (per_query_head) or the KV head.
Design: docs/kernels.md#line-attention-for-sparse-prefill"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Flash-attention-like tiles for D <= 128 in 16-bit (not yet tuned on a GPU: see
# benchmarks/kernels/gpu_line_attention.py); fp32 tiles are halved to fit in registers.
DEFAULT_CONFIG = dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
FP32_CONFIG = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
INT32_MAX = 2**31 - 1


@triton.jit
def _accumulate(m, l, acc, q, k, v, keep, scale_log2, PRECISION: tl.constexpr):
    """One online-softmax step over a [BLOCK_M, n] tile of keys; cells outside `keep` weigh 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen only masked cells keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m - shift)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l, acc


@triton.jit
def _line_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, q_start_ptr, kv_len_ptr,
    seg_lo_ptr, seg_hi_ptr, seg_limit_ptr, slash_ptr, prefix_ptr, vcol_ptr, vlimit_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_ot,
    T, num_offsets, max_segs, max_vert, num_blocks_m, scale_log2, window,
    Hq: tl.constexpr, H: tl.constexpr, G: tl.constexpr, U: tl.constexpr, PER_Q: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    hq = pid_bh % Hq
    h = hq // G
    if PER_Q:
        unit = b * U + hq
    else:
        unit = b * U + h
    q0 = tl.load(q_start_ptr + b)
    kv_len = tl.load(kv_len_ptr + b * H + h)

    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T
    pos = q0 + r  # absolute positions of the rows
    first_row = q0 + pid_m * BLOCK_M
    last_row = q0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    key_hi = tl.minimum(last_row, kv_len - 1)  # the last key any row of the block may see

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + hq * stride_qh + r[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b64 * stride_kb + h * stride_kh
    v_base = v_ptr + b64 * stride_vb + h * stride_vh
    slash = slash_ptr + unit * num_offsets
    prefix = prefix_ptr + unit * (num_offsets + 1)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # ---- 1. slash segments as ranges of key blocks --------------------------------------------
    n_segs = tl.load(seg_limit_ptr + unit * num_blocks_m + pid_m)  # segments with d0 <= last_row
    for i in range(0, n_segs):
        seg = unit * max_segs + n_segs - 1 - i  # largest offsets first = smallest keys first
        d0 = tl.load(seg_lo_ptr + seg)
        d1 = tl.load(seg_hi_ptr + seg)
        lo = tl.maximum(first_row - d1, 0)
        hi = tl.minimum(last_row - d0, key_hi)
        # Skip the blocks the previous segment (the next larger offsets) already swept. Its range
        # is recomputed from its own bounds rather than carried in a loop variable: compiled for a
        # GPU (Triton 3.6), a scalar carried across this loop and updated after the inner loop kept
        # its initial value, so blocks were read twice (on an H100; Triton's interpreter is exact).
        # Ranges ascend with the visiting order, so the previous segment's is the furthest one yet.
        has_prev = i > 0
        p0 = tl.load(seg_lo_ptr + seg + 1, mask=has_prev, other=0)
        p1 = tl.load(seg_hi_ptr + seg + 1, mask=has_prev, other=0)
        p_lo = tl.maximum(first_row - p1, 0)
        p_hi = tl.minimum(last_row - p0, key_hi)
        prev_blk = tl.where(has_prev & (p_hi >= p_lo), p_hi // BLOCK_N, -1)
        blk_lo = tl.maximum(lo // BLOCK_N, prev_blk + 1)
        blk_hi = tl.where(hi >= lo, hi // BLOCK_N, -1)
        for j in range(blk_lo, blk_hi + 1):
            c_lo = j * BLOCK_N
            # Offsets the block's causal cells can have; all selected -> no lookups.
            off_lo = tl.maximum(first_row - tl.minimum(c_lo + BLOCK_N - 1, key_hi), 0)
            off_hi = last_row - c_lo
            if HAS_WINDOW:
                off_hi = tl.minimum(off_hi, window - 1)
            full = tl.load(prefix + off_hi + 1) - tl.load(prefix + off_lo) == off_hi - off_lo + 1
            c = c_lo + tl.arange(0, BLOCK_N)
            c_ok = c <= key_hi
            delta = pos[:, None] - c[None, :]
            keep = row_ok[:, None] & c_ok[None, :] & (delta >= 0)
            if HAS_WINDOW:
                keep = keep & (delta < window)
            if not full:
                on_slash = tl.load(slash + tl.minimum(delta, num_offsets - 1), mask=keep, other=0)
                keep = keep & (on_slash != 0)
            k = tl.load(k_base + c[:, None] * stride_ks + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + c[:, None] * stride_vs + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            m, l, acc = _accumulate(m, l, acc, q, k, v, keep, scale_log2, PRECISION)

    # ---- 2. vertical columns, gathered, minus the cells already on a selected slash -----------
    n_vert = tl.load(vlimit_ptr + unit * num_blocks_m + pid_m)  # columns <= last_row
    for v0 in range(0, n_vert, BLOCK_N):
        idx = v0 + tl.arange(0, BLOCK_N)
        c_ok = idx < n_vert
        c = tl.load(vcol_ptr + unit * max_vert + idx, mask=c_ok, other=0)
        delta = pos[:, None] - c[None, :]
        keep = row_ok[:, None] & c_ok[None, :] & (delta >= 0)
        if HAS_WINDOW:
            keep = keep & (delta < window)
        on_slash = tl.load(slash + tl.minimum(delta, num_offsets - 1), mask=keep, other=0)
        keep = keep & (on_slash == 0)
        k = tl.load(k_base + c[:, None] * stride_ks + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + c[:, None] * stride_vs + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        m, l, acc = _accumulate(m, l, acc, q, k, v, keep, scale_log2, PRECISION)

    # A row with no cell at all (possible only with empty line sets) gets 0, as SDPA gives it.
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + b64 * stride_ob + hq * stride_oh + r[:, None] * stride_ot + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _compact(flags: torch.Tensor, values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """Per row, the values where flags is True, in order, left-aligned in [N, width] and padded."""
    N = flags.shape[0]
    out = torch.full((N, max(width, 1)), fill, dtype=torch.int32, device=flags.device)
    rank = flags.long().cumsum(dim=1) - 1
    rows, cols = flags.nonzero(as_tuple=True)
    out[rows, rank[rows, cols]] = values.expand_as(flags)[rows, cols].to(torch.int32)
    return out


class Plan:
    """The host-side description of a line set the kernel reads, built once per call (and reusable
    for several calls over the same lines, as the benchmark does).

    q_start [B], kv_len [B, H] int32; vertical [N, S] and slash [N, O] bool for N = B * U units.
    Slash flags past the model's window are dropped (those cells are outside the window anyway)."""

    def __init__(self, vertical, slash, q_start, kv_len, T: int, group: int, per_query_head: bool,
                 window: int | None, block_m: int):
        # Shapes: runs/segments [N, R] ascending, padded; per (unit, query block) counts [N, M].
        device = slash.device
        B, H = kv_len.shape
        U = vertical.shape[0] // B
        O = slash.shape[1]
        self.num_blocks_m = triton.cdiv(T, block_m)
        if window is not None:
            slash = slash & (torch.arange(O, device=device) < window)
        self.slash = slash.to(torch.int8).contiguous()
        counts = slash.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
        self.prefix = torch.nn.functional.pad(counts, (1, 0)).contiguous()  # selected offsets below i
        # Maximal runs of consecutive selected offsets: start where the previous offset is unselected.
        prev = torch.nn.functional.pad(slash[:, :-1], (1, 0))
        nxt = torch.nn.functional.pad(slash[:, 1:], (0, 1))
        starts, ends = slash & ~prev, slash & ~nxt
        unit_len = (kv_len.repeat_interleave(group, dim=1) if per_query_head and group > 1 else kv_len).reshape(-1)
        cols = torch.arange(vertical.shape[1], device=device)
        vertical = vertical & (cols < unit_len[:, None])
        self.run_count = starts.sum(dim=1).to(torch.int32)
        vert_count = vertical.sum(dim=1)
        # One host read for both widths (the kernel's index arrays are padded to them).
        widths = torch.stack([self.run_count.max(), vert_count.max()]).tolist()
        max_runs, self.max_vert = (max(int(x), 1) for x in widths)
        offsets = torch.arange(O, device=device)
        run_lo = _compact(starts, offsets, max_runs, INT32_MAX)
        run_hi = _compact(ends, offsets, max_runs, INT32_MAX)
        # Segments: a run more than block_m above the previous one starts a new segment.
        real = torch.arange(max_runs, device=device) < self.run_count[:, None]
        gap = run_lo[:, 1:].long() - run_hi[:, :-1].long()
        opens = real & torch.nn.functional.pad(gap > block_m, (1, 0), value=True)
        closes = real & torch.nn.functional.pad(opens[:, 1:] | ~real[:, 1:], (0, 1), value=True)
        self.seg_count = opens.sum(dim=1)
        self.max_segs = max_runs  # no host read: segments never outnumber runs
        self.seg_lo = _compact(opens, run_lo, max_runs, INT32_MAX)
        self.seg_hi = _compact(closes, run_hi, max_runs, INT32_MAX)
        self.vcol = _compact(vertical, cols, self.max_vert, INT32_MAX)
        # Per (unit, query block): how many segments start and columns lie at or before its last row.
        block_end = (torch.arange(self.num_blocks_m, device=device) * block_m + block_m).clamp_max(T)
        last = (q_start[:, None].long() + block_end - 1).repeat_interleave(U, dim=0).to(torch.int32)  # [N, M]
        self.seg_limit = torch.searchsorted(self.seg_lo, last, right=True).to(torch.int32).contiguous()
        self.vlimit = torch.searchsorted(self.vcol, last, right=True).to(torch.int32).contiguous()
        self.q_start = q_start.to(torch.int32).contiguous()
        self.kv_len = kv_len.to(torch.int32).contiguous()
        self.units, self.per_query_head, self.window = U, per_query_head, window


def line_attention(q, k, v, plan: Plan, scale: float | None = None, out: torch.Tensor | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] over k, v [B, H, S, D] (last dim contiguous) on the plan's lines -> [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    scale = D**-0.5 if scale is None else scale
    launch = {**(FP32_CONFIG if q.dtype == torch.float32 else DEFAULT_CONFIG), **(config or {})}
    assert triton.cdiv(T, launch["block_m"]) == plan.num_blocks_m, "the plan was built for another block_m"
    grid = (plan.num_blocks_m, B * Hq)
    _line_attention[grid](
        q, k, v, out, plan.q_start, plan.kv_len,
        plan.seg_lo, plan.seg_hi, plan.seg_limit, plan.slash, plan.prefix, plan.vcol, plan.vlimit,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T, plan.slash.shape[1], plan.max_segs, plan.max_vert, plan.num_blocks_m, scale * LOG2E, plan.window or 0,
        Hq=Hq, H=H, G=Hq // H, U=plan.units, PER_Q=plan.per_query_head, D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=launch["block_m"], BLOCK_N=launch["block_n"], HAS_WINDOW=plan.window is not None,
        # fp32 stays fp32: tensor cores would round the inputs to TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    return out


def block_m_for(dtype: torch.dtype, config: dict | None = None) -> int:
    return {**(FP32_CONFIG if dtype == torch.float32 else DEFAULT_CONFIG), **(config or {})}["block_m"]
