"""Paged chunk attention: T new queries of each sequence over everything its heads keep in the paged
store (kept history plus the chunk itself, already written), read through the page tables in place.

Contract (reference.paged_chunk): head h of sequence b holds lengths[b, h] entries, the T new tokens
last; entry j lives at slot table[b, h, j // PAGE] * PAGE + j % PAGE of one layer's pool. New token t
sees the entries j <= lengths[b, h] - T + t (all kept history, the chunk up to itself); with a sliding
window only those whose position is above query_positions[b, t] - window, or below `sink` (one window
for all heads, or one per KV head: LServe's streaming heads, sink + local). Heads may hold different
numbers of entries (compressed, uneven heads); lengths need not be a multiple of the page size.
int8 / fp8 pools: codes cast in registers, one fp32 scale per slot. Design: docs/kernels.md#paged-chunk-attention"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Launch settings per head dim for 16-bit queries (benchmarks/prefill/chunk_attention.py --sweep times
# the alternatives); fp32 queries take FP32_CONFIG, small enough for fp32 tiles in registers.
DEFAULT_CONFIG = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
FP32_CONFIG = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
# A ring launch without splits (a long chunk's streaming heads): taller row blocks share each key
# tile among more rows (benchmarks/prefill/ring_configs.py).
RING_CONFIG = dict(block_m=256, block_n=64, num_warps=16, num_stages=3)
# Keys per split at least; splits aim at PROGRAMS_PER_SM programs per SM (choose_splits).
MIN_SPLIT_KEYS = 1024
PROGRAMS_PER_SM = 2


@triton.jit
def _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, key_pos_ptr, lo, hi, last_visible, lowest,
           lowest_min, sink, scale_log2, d, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
           MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
           first_entry, ENTRY_FLOOR: tl.constexpr):
    """Online softmax of the block's rows over the key tiles [lo, hi).
    MASKED: keys past hi and past a row's last_visible entry weigh 0 (and with ENTRY_FLOOR, entries
    below the row's first_entry [BLOCK_M]); otherwise every row sees every key of [lo, hi) and
    hi - lo is a multiple of BLOCK_N. With a window (HAS_WINDOW: by key position), a tile none of
    whose keys is in any row's view (above lowest_min, the block's lowest bound, or below the sink)
    is skipped before its keys and values are read."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = n < hi
            page = tl.load(table + n // PAGE, mask=valid, other=0)
        else:
            page = tl.load(table + n // PAGE)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        in_view = True
        if HAS_WINDOW:
            key_pos = tl.load(key_pos_ptr + slot)  # in bounds: page 0 where masked
            seen = (key_pos > lowest_min) | (key_pos < sink)
            if MASKED:
                seen = seen & valid
            in_view = tl.max(seen.to(tl.int32), 0) > 0
        if in_view:
            if MASKED:
                k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            else:
                k = tl.load(k_ptr + slot[:, None] * D + d[None, :])
            if QUANT:
                k_scale = tl.load(ks_ptr + slot)  # in bounds: page 0 where masked
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION).to(tl.float32)
                s = s * (k_scale * scale_log2)[None, :]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
            if MASKED:
                keep = (n[None, :] <= last_visible[:, None]) & valid[None, :]
                if ENTRY_FLOOR:
                    keep = keep & (n[None, :] >= first_entry[:, None])
                if HAS_WINDOW:
                    keep = keep & ((key_pos[None, :] > lowest[:, None]) | (key_pos[None, :] < sink))
                s = tl.where(keep, s, float("-inf"))
            elif HAS_WINDOW:
                s = tl.where((key_pos[None, :] > lowest[:, None]) | (key_pos[None, :] < sink), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row that has seen only masked keys keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - shift[:, None])
            alpha = tl.exp2(m - shift)
            row_sum = row_sum * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            else:
                v = tl.load(v_ptr + slot[:, None] * D + d[None, :])
            if QUANT:
                v_scale = tl.load(vs_ptr + slot)
                pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m = m_new
    return acc, m, row_sum


@triton.jit
def _all_keys(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, key_pos_ptr, query_pos_ptr, head_window_ptr,
              h, b64, t, row_ok, T, last_visible, kv_end, full_end, split, num_splits, window, sink, scale_log2, d,
              D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HEAD_WINDOW: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr):
    """The block's rows over the split's share of entries [0, kv_end): any kept keys, a window by
    position checked tile by tile."""
    per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * per_split, kv_end)
    end = tl.minimum(start + per_split, kv_end)
    mid = start + tl.maximum(tl.minimum(end, full_end) - start, 0) // BLOCK_N * BLOCK_N
    lowest = last_visible  # unused without a window
    lowest_min = 0
    if HAS_WINDOW:
        # Keys at or below this position are outside a row's window (those below `sink` stay in view).
        if HEAD_WINDOW:
            window = tl.load(head_window_ptr + h).to(tl.int64)
        lowest = tl.load(query_pos_ptr + b64 * T + t, mask=row_ok, other=0).to(tl.int64) - window
        lowest_min = tl.min(tl.where(row_ok, lowest, 1 << 62), 0)  # the block's rows that exist
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, key_pos_ptr, start, mid,
                             last_visible, lowest, lowest_min, sink, scale_log2, d, D, PAGE, BLOCK_N, False,
                             HAS_WINDOW, QUANT, PRECISION, last_visible, False)
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, key_pos_ptr, mid, end,
                             last_visible, lowest, lowest_min, sink, scale_log2, d, D, PAGE, BLOCK_N, True,
                             HAS_WINDOW, QUANT, PRECISION, last_visible, False)
    return acc, m, row_sum


@triton.jit
def _ring(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, head_window_ptr, h, length, T, first_t, last_t,
          last_visible, kv_end, full_end, split, num_splits, sink, scale_log2, d, D: tl.constexpr,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr):
    """The block's rows over only the entries they see, for a head in ring form: entries [0, s0) at
    positions [0, s0) (s0 = min(sink, length): the sink, seen by every later row), then a run of
    consecutive positions ending at the newest, where a row sees the last `window` entries up to
    its own (entry and position differ by a constant). The iterator of LServe's block-sparse
    prefill: the sink's tiles, then the window's, nothing between; only the edge tiles masked.
    The split's share is of the entries visited, so splits even out a head's work."""
    window = tl.minimum(tl.load(head_window_ptr + h), length + 1)  # a head without a window sees all
    s0 = tl.minimum(sink, length)
    first_entry = last_visible - window + 1  # [BLOCK_M]: a row's first entry past the sink
    lo_first = length - T + first_t - window + 1  # the block's first row's (the lowest)
    lo_last = length - T + last_t - window + 1  # its last row's (the highest)
    run_start = tl.maximum(s0, lo_first)
    sink_len = tl.minimum(s0, kv_end)
    visits = sink_len + tl.maximum(kv_end - run_start, 0)
    per_split = tl.cdiv(tl.cdiv(visits, num_splits), BLOCK_N) * BLOCK_N
    v0 = tl.minimum(split * per_split, visits)
    v1 = tl.minimum(v0 + per_split, visits)
    # The sink: every row sees an entry below s0 from its own row on (causal).
    a0 = tl.minimum(v0, sink_len)
    a1 = tl.minimum(v1, sink_len)
    a_mid = a0 + tl.maximum(tl.minimum(a1, full_end) - a0, 0) // BLOCK_N * BLOCK_N
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, ks_ptr, a0, a_mid,
                             last_visible, last_visible, 0, 0, scale_log2, d, D, PAGE, BLOCK_N, False,
                             False, QUANT, PRECISION, last_visible, False)
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, ks_ptr, a_mid, a1,
                             last_visible, last_visible, 0, 0, scale_log2, d, D, PAGE, BLOCK_N, True,
                             False, QUANT, PRECISION, last_visible, False)
    # The run: masked below the block's highest first entry and past its lowest last one.
    b0 = run_start + tl.maximum(v0 - sink_len, 0)
    b1 = run_start + tl.maximum(v1 - sink_len, 0)
    m0 = tl.minimum(b0 + tl.cdiv(tl.maximum(lo_last - b0, 0), BLOCK_N) * BLOCK_N, b1)
    m1 = m0 + tl.maximum(tl.minimum(full_end, b1) - m0, 0) // BLOCK_N * BLOCK_N
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, ks_ptr, b0, m0,
                             last_visible, last_visible, 0, 0, scale_log2, d, D, PAGE, BLOCK_N, True,
                             False, QUANT, PRECISION, first_entry, True)
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, ks_ptr, m0, m1,
                             last_visible, last_visible, 0, 0, scale_log2, d, D, PAGE, BLOCK_N, False,
                             False, QUANT, PRECISION, last_visible, False)
    acc, m, row_sum = _tiles(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, ks_ptr, m1, b1,
                             last_visible, last_visible, 0, 0, scale_log2, d, D, PAGE, BLOCK_N, True,
                             False, QUANT, PRECISION, first_entry, True)
    return acc, m, row_sum


# T, the block count, the split count, the tables' widths, the window and the sink change from call to
# call: not specialised on, so a new chunk or history length never compiles a new variant mid-serving.
@triton.jit(do_not_specialize=["stride_tb", "stride_th", "T", "num_blocks_m", "num_splits", "window", "sink",
                            "num_heads"])
def _chunk_attention(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lengths_ptr, key_pos_ptr, query_pos_ptr, head_window_ptr,
    out_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qt, stride_tb, stride_th, stride_lb, stride_ob, stride_oh, stride_ot,
    T, num_blocks_m, num_splits, scale_log2, window, sink, heads_ptr, num_heads,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_WINDOW: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr, RING: tl.constexpr,
    HEAD_SUBSET: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if HEAD_SUBSET:  # program bh runs KV head heads[bh % num_heads] of sequence bh // num_heads
        b = bh // num_heads
        h = tl.load(heads_ptr + bh % num_heads)
    else:
        b = bh // H
        h = bh % H
    # The last row blocks (most keys on the diagonal) first.
    block = num_blocks_m - 1 - pid // num_splits
    split = pid % num_splits
    length = tl.load(lengths_ptr + b * stride_lb + h).to(tl.int32)

    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // G
    row_ok = t < T
    hq = h * G + r % G
    first_t = (block * BLOCK_M) // G
    last_t = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    last_visible = length - T + t  # [BLOCK_M]: a row's last visible entry
    # Keys the block needs, and the prefix every one of its rows sees.
    kv_end = tl.maximum(tl.minimum(length - T + last_t + 1, length), 0)
    full_end = tl.maximum(tl.minimum(length - T + first_t + 1, kv_end), 0)

    d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + hq[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    table = table_ptr + b64 * stride_tb + h * stride_th
    if RING:
        acc, m, row_sum = _ring(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, head_window_ptr, h, length,
                                T, first_t, last_t, last_visible, kv_end, full_end, split, num_splits, sink,
                                scale_log2, d, D, PAGE, BLOCK_N, QUANT, PRECISION)
    else:
        acc, m, row_sum = _all_keys(acc, m, row_sum, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, key_pos_ptr,
                                    query_pos_ptr, head_window_ptr, h, b64, t, row_ok, T, last_visible, kv_end,
                                    full_end, split, num_splits, window, sink, scale_log2, d, D, PAGE, BLOCK_N,
                                    HAS_WINDOW, HEAD_WINDOW, QUANT, PRECISION)

    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if SPLIT:
        # Partials [B, Hq, T, num_splits, D] (fp32, normalised) and their log2-sum-exp [B, Hq, T, num_splits].
        row = ((b64 * H * G + hq) * T + t) * num_splits + split
        tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(row_sum > 0, m + tl.log2(tl.where(row_sum > 0, row_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)
    else:
        tl.store(out_ptr + b64 * stride_ob + hq[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["rows", "T", "num_splits"])
def _merge_splits(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, stride_ot, rows, T, num_splits,
                  Hq: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[b, hq, t] = the splits' partials weighted by exp2(lse); rows = B * Hq * T, in that order."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    r64 = r.to(tl.int64)
    d = tl.arange(0, D)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + r64 * num_splits + s, mask=r_ok, other=float("-inf"))
        m_new = tl.maximum(m, lse)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        w = tl.exp2(lse - shift)
        part = tl.load(part_ptr + (r64 * num_splits + s)[:, None] * D + d[None, :], mask=r_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + part * w[:, None]
        w_sum = w_sum * alpha + w
        m = m_new
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    b = r64 // (Hq * T)
    hq = (r64 // T) % Hq
    t = r64 % T
    row = b * stride_ob + hq * stride_oh + t * stride_ot
    tl.store(out_ptr + row[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes: a power-of-two head dim from 16 to 256, contiguous pages."""
    D = q.shape[-1]
    return 16 <= D <= 256 and D & (D - 1) == 0 and q.stride(-1) == 1 and k_cache.is_contiguous()


def launch_config(dtype: torch.dtype, D: int, config: dict | None = None) -> dict:
    launch = dict(FP32_CONFIG if dtype == torch.float32 else DEFAULT_CONFIG)
    if D > 128:
        launch.update(block_m=64, block_n=32)
    return {**launch, **(config or {})}


def choose_splits(batch_kv_heads: int, num_blocks_m: int, max_keys: int, num_sms: int,
                  programs_per_sm: int = PROGRAMS_PER_SM, min_keys: int = MIN_SPLIT_KEYS) -> int:
    """Splits of each block's keys: at most `programs_per_sm` programs per SM, and at least two splits
    (they even out the causal blocks' unequal key counts), none shorter than `min_keys` keys (each
    split costs a partial's write and read in the merge)."""
    programs = batch_kv_heads * num_blocks_m
    want = max(2, programs_per_sm * num_sms // max(programs, 1))
    return max(1, min(want, max_keys // min_keys, 64))


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, num_splits: int = 1, scale: float | None = None,
                    window: int | None = None, key_positions: torch.Tensor | None = None,
                    query_positions: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    config: dict | None = None, sink: int = 0, ring: bool = False,
                    heads: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] (last dim contiguous) over one layer's pool k_cache, v_cache [num_pages, PAGE, D]
    through table [B, H, P] and lengths [B, H] (int32 or int64) -> [B, Hq, T, D] in q's dtype, a view of
    a [B, T, Hq, D] tensor (or into `out`, any [B, Hq, T, D] view with a contiguous last dim).
    window: keys whose position (key_positions [num_pages, PAGE]) is at or below query_positions
    [B, T] - window are not seen, except those below `sink`; an int, or an int32 tensor [H] of one
    window per KV head (a head with no window: one past any position). k_scale, v_scale [num_pages,
    PAGE] fp32: the scales of int8 / fp8 codes. num_splits: key splits per block (choose_splits).
    config: block_m, block_n, num_warps, num_stages (launch_config's defaults).
    ring: every head with a window (a tensor [H]) is in ring form (its first min(sink, length)
    entries at positions below `sink`, the rest at consecutive positions ending at the newest):
    the kernel then visits only the sink's and the window's tiles and reads no positions.
    heads: int32 [n], the only KV heads computed (their query heads' rows of `out` written, the
    others untouched); one split then."""
    B, Hq, T, D = q.shape
    H = table.shape[1]
    G = Hq // H
    page = k_cache.shape[1]
    assert supports(q, k_cache) and v_cache.is_contiguous() and table.stride(-1) == 1 and lengths.stride(-1) == 1
    quantized = k_scale is not None
    if quantized:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.dtype == v_scale.dtype == torch.float32
    else:
        k_scale = v_scale = lengths  # unused
    if out is None:
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    launch = launch_config(q.dtype, D, config)
    if ring and num_splits == 1 and config is None and q.dtype != torch.float32 and D <= 128:
        launch.update(RING_CONFIG)
    block_m = launch["block_m"]
    num_blocks_m = triton.cdiv(G * T, block_m)
    split = num_splits > 1
    if split:
        part = torch.empty(B * Hq * T * num_splits * D, device=q.device, dtype=torch.float32)
        lse = torch.empty(B * Hq * T * num_splits, device=q.device, dtype=torch.float32)
    else:
        part = lse = out  # unused
    has_window = window is not None
    head_window = isinstance(window, torch.Tensor)
    if head_window:
        assert window.shape == (H,) and window.dtype == torch.int32 and window.is_contiguous()
    assert not ring or head_window, "ring form is per head: window is a tensor [H]"
    if heads is not None:
        assert heads.dtype == torch.int32 and heads.dim() == 1 and heads.is_contiguous() and num_splits == 1
    key_pos = key_positions if has_window and not ring else lengths  # the ring reads no positions
    query_pos = query_positions.contiguous() if has_window and not ring else lengths
    scale = D**-0.5 if scale is None else scale
    num_heads = H if heads is None else heads.shape[0]
    if num_heads == 0:
        return out
    _chunk_attention[(num_blocks_m * num_splits, B * num_heads)](
        q, k_cache, v_cache, k_scale, v_scale, table, lengths, key_pos, query_pos,
        window if head_window else lengths, out, part, lse,
        q.stride(0), q.stride(1), q.stride(2), table.stride(0), table.stride(1), lengths.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        T, num_blocks_m, num_splits, scale * LOG2E, 0 if head_window or window is None else window, sink,
        lengths if heads is None else heads, num_heads,
        H=H, G=G, D=D, PAGE=page, BLOCK_M=block_m, BLOCK_N=launch["block_n"], SPLIT=split,
        HAS_WINDOW=has_window and not ring, HEAD_WINDOW=head_window, QUANT=quantized, RING=ring,
        HEAD_SUBSET=heads is not None,
        # fp32 stays fp32: tensor cores would round the inputs to TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    if split:
        rows, block_r = B * Hq * T, 32
        _merge_splits[(triton.cdiv(rows, block_r),)](part, lse, out, out.stride(0), out.stride(1), out.stride(2),
                                                     rows, T, num_splits, Hq=Hq, D=D, BLOCK_R=block_r, num_warps=4)
    return out
