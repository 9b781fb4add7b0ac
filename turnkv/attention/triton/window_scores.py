"""LoopServe's re-selection score inside a CUDA graph: per head, the softmax attention weights of the
observation window's queries summed per key, over every key the head holds, read through its page table.

A window query at position p sees the keys at positions <= p; a slot with position < 0 is empty. The
current token (the head's last key) is in the softmax but scores -inf; keys below `sinks` score +inf;
blocks past the head's history write -inf. Quantized keys are read as codes times their scale.
Torch reference: turnkv/methods/loopserve/decode.py `window_scores`.
Design: docs/kernels.md#loopserves-window-scores"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Launch settings of the two passes (warps and software-pipeline depth of each).
# Pass 1 runs max_splits chunks of at least keys_per_split keys per (sequence, KV head); block_n (the
# function's argument) keys a tile in both passes unless lse_block_n / weights_block_n say otherwise.
LAUNCH = dict(lse_warps=4, lse_stages=3, weights_warps=4, weights_stages=3, max_splits=64, keys_per_split=4096)


@triton.jit
def _load_window(q_ptr, qpos_ptr, b, h, stride_qb, stride_qw, stride_qh, stride_pb,
                 G: tl.constexpr, W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr):
    m = tl.arange(0, BLOCK_G * BLOCK_W)
    g = m // BLOCK_W
    w = m % BLOCK_W
    d = tl.arange(0, BLOCK_D)
    qpos = tl.load(qpos_ptr + b * stride_pb + w, mask=w < W, other=-1)
    row_ok = (g < G) & (w < W) & (qpos >= 0)
    q = tl.load(q_ptr + b * stride_qb + w[:, None] * stride_qw + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    return q, qpos, row_ok


@triton.jit
def _scores(q, k_ptr, ks_ptr, slot, valid, d, scale_log2, D: tl.constexpr, PRECISION: tl.constexpr,
            QUANT: tl.constexpr):
    """q . k * scale (log2 units) of the window rows against the keys at `slot`, fp32.

    One return after an if/else: compiled for a GPU, Triton also type-checks the code after a return
    inside a constexpr `if`, whose dot of q with the int8 / fp8 codes then fails."""
    k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    if QUANT:
        k_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION).to(tl.float32)
        s = s * (k_scale * scale_log2)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
    return s


# The split count follows the batch and the capacity: a runtime value, so an eager step of a new batch
# size compiles nothing mid-serving.
@triton.jit(do_not_specialize=["num_splits"])
def _window_lse(q_ptr, qpos_ptr, k_ptr, ks_ptr, kpos_ptr, table_ptr, lengths_ptr, m_ptr, l_ptr,
                stride_qb, stride_qw, stride_qh, stride_pb, stride_tb, stride_th, stride_lb, scale_log2, num_splits,
                H: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
                D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr, QUANT: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(lengths_ptr + b * stride_lb + h)
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    q, qpos, row_ok = _load_window(q_ptr, qpos_ptr, b, h, stride_qb, stride_qw, stride_qh, stride_pb,
                                   G, W, BLOCK_G, BLOCK_W, D, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    M: tl.constexpr = BLOCK_G * BLOCK_W
    mx = tl.full([M], float("-inf"), tl.float32)
    sm = tl.zeros([M], tl.float32)
    table = table_ptr + b * stride_tb + h * stride_th
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        valid = t < end
        page = tl.load(table + t // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + t % PAGE
        s = _scores(q, k_ptr, ks_ptr, slot, valid, d, scale_log2, D, PRECISION, QUANT)
        kpos = tl.load(kpos_ptr + slot, mask=valid, other=0)
        keep = valid[None, :] & row_ok[:, None] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(keep, s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, 1))
        shift = tl.where(new == float("-inf"), 0.0, new)
        sm = sm * tl.exp2(mx - shift) + tl.sum(tl.exp2(s - shift[:, None]), 1)
        mx = new
    m = tl.arange(0, M)
    base = (bh * num_splits + split) * M
    tl.store(m_ptr + base + m, mx)
    tl.store(l_ptr + base + m, sm)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_partials(m_ptr, l_ptr, lse_ptr, num_splits, M: tl.constexpr):
    """Per (sequence, KV head): the rows' log2-sum-exp from pass 1's partials, once (-inf: a row that
    sees no key), so that pass 2's programs read M numbers instead of merging num_splits x M each."""
    bh = tl.program_id(0)
    m = tl.arange(0, M)
    mx = tl.full([M], float("-inf"), tl.float32)
    sm = tl.zeros([M], tl.float32)
    for s_ in range(num_splits):
        base = (bh * num_splits + s_) * M
        pm = tl.load(m_ptr + base + m)
        pl = tl.load(l_ptr + base + m)
        new = tl.maximum(mx, pm)
        shift = tl.where(new == float("-inf"), 0.0, new)
        sm = sm * tl.exp2(mx - shift) + pl * tl.exp2(pm - shift)
        mx = new
    tl.store(lse_ptr + bh * M + m, tl.where(sm > 0, mx + tl.log2(tl.where(sm > 0, sm, 1.0)), float("-inf")))


@triton.jit
def _window_weights(q_ptr, qpos_ptr, k_ptr, ks_ptr, kpos_ptr, table_ptr, lengths_ptr, lse_ptr, out_ptr,
                    stride_qb, stride_qw, stride_qh, stride_pb, stride_tb, stride_th, stride_lb,
                    stride_ob, stride_or, scale_log2, capacity, sinks,
                    H: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, PER_KV: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr):
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(lengths_ptr + b * stride_lb + h)
    history = length - 1  # the current token is read as a recent one, not chosen
    t = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    M: tl.constexpr = BLOCK_G * BLOCK_W
    gs = tl.arange(0, BLOCK_G)
    scores = tl.full([BLOCK_G, BLOCK_N], float("-inf"), tl.float32)
    if blk * BLOCK_N < history:
        q, qpos, row_ok = _load_window(q_ptr, qpos_ptr, b, h, stride_qb, stride_qw, stride_qh, stride_pb,
                                       G, W, BLOCK_G, BLOCK_W, D, BLOCK_D)
        lse = tl.load(lse_ptr + bh * M + tl.arange(0, M))
        row_ok = row_ok & (lse > float("-inf"))
        valid = t < history
        d = tl.arange(0, BLOCK_D)
        page = tl.load(table_ptr + b * stride_tb + h * stride_th + t // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + t % PAGE
        s = _scores(q, k_ptr, ks_ptr, slot, valid, d, scale_log2, D, PRECISION, QUANT)
        kpos = tl.load(kpos_ptr + slot, mask=valid, other=0)
        keep = valid[None, :] & row_ok[:, None] & (kpos[None, :] <= qpos[:, None])
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        summed = tl.sum(tl.reshape(p, (BLOCK_G, BLOCK_W, BLOCK_N)), 1)  # over the window: [BLOCK_G, BLOCK_N]
        summed = tl.where((kpos < sinks)[None, :], float("inf"), summed)
        scores = tl.where(valid[None, :], summed, float("-inf"))
    in_range = t < capacity
    if PER_KV:
        row = tl.sum(tl.where((gs < G)[:, None], scores, 0.0), 0)
        row = tl.where(t < history, row, float("-inf"))
        tl.store(out_ptr + b * stride_ob + h * stride_or + t, row, mask=in_range)
    else:
        tl.store(out_ptr + b * stride_ob + (h * G + gs)[:, None] * stride_or + t[None, :], scores,
                 mask=(gs < G)[:, None] & in_range[None, :])


def window_scores(q: torch.Tensor, qpos: torch.Tensor, k_pool: torch.Tensor, kpos_pool: torch.Tensor,
                  table: torch.Tensor, lengths: torch.Tensor, capacity: int, per_kv: bool = False, sinks: int = 0,
                  num_splits: int | None = None, block_n: int = 128, k_scale: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """q [B, W, Hq, D] window queries (post-RoPE), qpos [B, W] int64 (< 0: empty slot); k_pool one
    layer's keys [pages, page_size, D], kpos_pool its positions [pages, page_size]; table [B, H, P]
    int32 page ids, lengths [B, H] int32 (the current token included). -> fp32 [B, X, capacity]
    (X = H with per_kv, else Hq): summed window weights of the history keys, -inf elsewhere.
    k_scale: for int8 / fp8 key codes, the fp32 scale of each slot [pages, page_size].
    block_n: keys per tile (128 is faster than 64 at 128K on an H100). Pass 2 reads each row's merged
    log-sum-exp, so no program merges pass 1's partials itself.
    config overrides the launch settings (LAUNCH's keys), for tuning."""
    launch = {**LAUNCH, **(config or {})}
    B, W, Hq, D = q.shape
    H = table.shape[1]
    G = Hq // H
    PAGE = k_pool.shape[1]
    assert q.stride(-1) == 1 and k_pool.is_contiguous() and kpos_pool.is_contiguous() and table.stride(-1) == 1
    if num_splits is None:
        num_splits = max(1, min(launch["max_splits"], math.ceil(capacity / launch["keys_per_split"])))
    BLOCK_G, BLOCK_W = triton.next_power_of_2(G), max(16, triton.next_power_of_2(W))
    M = BLOCK_G * BLOCK_W
    part_m = torch.empty(B * H * num_splits * M, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    lse = torch.empty(B * H * M, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H if per_kv else Hq, capacity, dtype=torch.float32, device=q.device)
    scale_log2 = D**-0.5 * LOG2E
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(H=H, G=G, W=W, BLOCK_G=BLOCK_G, BLOCK_W=BLOCK_W, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                  PAGE=PAGE, PRECISION=precision, QUANT=k_scale is not None)
    lse_block_n, weights_block_n = launch.get("lse_block_n", block_n), launch.get("weights_block_n", block_n)
    if k_scale is None:
        k_scale = lengths  # unused
    else:
        assert k_scale.is_contiguous() and k_scale.dtype == torch.float32
    strides = (q.stride(0), q.stride(1), q.stride(2), qpos.stride(0), table.stride(0), table.stride(1),
               lengths.stride(0))
    _window_lse[(B * H, num_splits)](q, qpos, k_pool, k_scale, kpos_pool, table, lengths, part_m, part_l, *strides,
                                     scale_log2, num_splits, BLOCK_N=lse_block_n,
                                     num_warps=launch["lse_warps"], num_stages=launch["lse_stages"], **common)
    _merge_partials[(B * H,)](part_m, part_l, lse, num_splits, M=M, num_warps=1)
    _window_weights[(B * H, triton.cdiv(capacity, weights_block_n))](
        q, qpos, k_pool, k_scale, kpos_pool, table, lengths, lse, out, *strides, out.stride(0), out.stride(1),
        scale_log2, capacity, sinks, PER_KV=per_kv, BLOCK_N=weights_block_n, num_warps=launch["weights_warps"],
        num_stages=launch["weights_stages"], **common)
    return out
