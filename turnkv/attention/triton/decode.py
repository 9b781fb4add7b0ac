"""Indexed decode attention: one query token per sequence over a list of token slots in the paged store.

Per (sequence, KV head) the keys are table [B, H, P] (page ids) and lengths [B, H]: token t of a list
lives at slot table[t // page_size] * page_size + t % page_size, so page tables and slot lists
(page_size=1) take the same kernel. Flash-decoding over `num_splits` chunks merged by log-sum-exp; the
grid is fixed and the chunk sizes come from the device's lengths, so launches sit in CUDA graphs.
int8 / fp8 KV is read as codes with one fp32 scale per slot, dequantized in registers (DEQUANT).
Design: docs/kernels.md#indexed-decode-attention"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from turnkv.model.triton import pdl

LOG2E = 1.4426950408889634
# The setting of benchmarks/kernels/gpu_decode_kernel.py --sweep whose share of the copy bandwidth is the most
# even from batch 1 x 32K to batch 32 x 16K keys.
DEFAULT_CONFIG = dict(block_n=32, num_warps=2, num_stages=3)
# Per storage dtype of quantized KV (benchmarks/decode/gpu_kv_quant.py times the choices): the launch
# settings (one-byte codes: 128-key tiles over 4 warps keep as many bytes in flight per stage as the
# setting above), how the codes are dequantized in registers (docs/kernels.md), and how many
# programs per SM choose_splits aims at (4 otherwise: one-byte codes need more programs in flight to
# come near the copy bandwidth; benchmarks/decode/gpu_kv_quant_splits.py sweeps it).
QUANT_CONFIG = {torch.int8: dict(block_n=128, num_warps=4, num_stages=3),
                torch.float8_e4m3fn: dict(block_n=128, num_warps=4, num_stages=2)}
DEQUANT = {torch.int8: "f16asm", torch.float8_e4m3fn: "cast"}
PROGRAMS_PER_SM = {torch.int8: 8, torch.float8_e4m3fn: 8}
# A decode selection's lists (LServe's 4096 selected tokens a row): chunks of about 64 keys, which
# finish sooner than 17 chunks of 241 (benchmarks/sparse/README.md, the launch sweep).
SELECTED_PROGRAMS_PER_SM = 16
_QUANT_MODE = {"cast": 1, "fp32": 2, "f16asm": 3}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: no inline PTX


@triton.jit
def codes_to_f32(c, FP8: tl.constexpr):
    """int8 or fp8 e4m3 codes -> their exact values in fp32, without conversion instructions.

    One return in each branch of an if/else: compiled for a GPU, Triton also type-checks the code
    after a return inside a constexpr `if`, which casts fp8 codes to int32 and fails."""
    if FP8:
        b = c.to(tl.uint8, bitcast=True).to(tl.int32)
        # sign to bit 31, exponent and mantissa to bits 26..20 (an fp32 with exponent e - 127 + ...):
        # times 2**120 re-biases 127 to e4m3's 7 (subnormal codes become fp32 subnormals, exactly).
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        x = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
    else:
        x = (c.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return x


@triton.jit
def int8_to_f16(c):
    """int8 codes -> the same values in fp16, four codes per 32-bit register in five instructions:
    flip the sign bit (c + 128, unsigned), put each byte under the exponent byte 0x64 (fp16 1024 + byte,
    exact: fp16's ulp at 1024 is 1) and subtract 1152 from both halves at once."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m;
        xor.b32 t, $2, 0x80808080;
        mov.b32 m, 0x64806480;
        prmt.b32 $0, t, 0x64646464, 0x5150;
        prmt.b32 $1, t, 0x64646464, 0x5352;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }""",
        constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True, pack=4)


# The split count, the tables' widths and the window change with the batch and its lengths: not
# specialised on, so an eager step of a new batch size never compiles a new variant mid-serving.
@triton.jit(do_not_specialize=["stride_tb", "stride_th", "window", "num_splits"])
def _decode_chunk(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lengths_ptr, key_pos_ptr, query_pos_ptr,
    out_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_oh,
    scale_log2, window, num_splits,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr, PRECISION32: tl.constexpr, GDC: tl.constexpr,
    EARLY: tl.constexpr,
):
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(lengths_ptr + b * stride_lb + h)
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_WINDOW:
        lowest = tl.load(query_pos_ptr + b) - window  # keys at or below this position are outside
    if QUANT == 2:
        q32 = q.to(tl.float32)
    if QUANT == 3:
        q16 = q.to(tl.float16)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = table_ptr + b * stride_tb + h * stride_th
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        valid = t < end
        page = tl.load(table + t // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + t % PAGE
        if HAS_WINDOW:
            valid = valid & (tl.load(key_pos_ptr + slot, mask=valid, other=0) > lowest)
        k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if QUANT == 2:
            k_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0)
            s = tl.dot(q32, tl.trans(codes_to_f32(k, FP8)), input_precision=PRECISION32)
            s = s * (k_scale * scale_log2)[None, :]
        elif QUANT == 3:
            k_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0)
            s = tl.dot(q16, tl.trans(int8_to_f16(k))).to(tl.float32)
            s = s * (k_scale * scale_log2)[None, :]
        elif QUANT == 1:
            k_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION).to(tl.float32)
            s = s * (k_scale * scale_log2)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m - shift)
        v = tl.load(v_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        l = l * alpha + tl.sum(p, 1)
        if QUANT == 2:
            v_scale = tl.load(vs_ptr + slot, mask=valid, other=0.0)
            pv = tl.dot(p * v_scale[None, :], codes_to_f32(v, FP8), input_precision=PRECISION32)
        elif QUANT == 3:
            v_scale = tl.load(vs_ptr + slot, mask=valid, other=0.0)
            pv = tl.dot((p * v_scale[None, :]).to(tl.float16), int8_to_f16(v))
        elif QUANT == 1:
            v_scale = tl.load(vs_ptr + slot, mask=valid, other=0.0)
            pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        m = m_new

    rows = h * G + g
    if not SPLIT:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        # Partials [B, Hq, num_splits, D] (normalised) and their log2-sum-exp [B, Hq, num_splits].
        base = (b * H * G + rows) * num_splits + split
        tl.store(part_ptr + base[:, None] * D + d[None, :], acc / tl.where(l > 0, l, 1.0)[:, None],
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + base, tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf")), mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_chunks(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_splits, Hq: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  GDC: tl.constexpr, EARLY: tl.constexpr):
    """BLOCK_S: num_splits rounded up to a power of two (at most eight variants of this small kernel)."""
    pdl.enter(GDC, EARLY)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    row = tl.program_id(0)  # b * Hq + query head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    part = tl.load(part_ptr + (row * num_splits + s)[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :],
                   other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    b = row // Hq
    h = row % Hq
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def dequant_mode(codes: torch.dtype, query: torch.dtype, requested: str | None = None) -> str:
    """How the kernel dequantizes `codes` (int8 / fp8) for a `query`-dtype query: `requested`, else
    DEQUANT's choice for the codes. The one choice here that depends on where the kernel runs: "f16asm"
    (inline PTX) becomes "cast" under Triton's interpreter (the CPU tests), which runs no inline PTX,
    and for an fp32 query, which would lose bits in fp16. So on a GPU a bf16 / fp16 model reads int8
    codes through "f16asm", and the interpreted kernel tests check int8 through "cast"."""
    assert codes in DEQUANT, f"no dequantization for {codes} codes"
    mode = requested or DEQUANT[codes]
    if mode == "f16asm" and (_INTERPRETED or query == torch.float32):
        mode = "cast"
    assert mode != "f16asm" or codes == torch.int8, "f16asm dequantizes int8 codes only"
    return mode


def choose_splits(batch_kv_heads: int, max_length: int, num_sms: int, min_chunk: int = 64,
                  programs_per_sm: int = 4) -> int:
    """Enough chunks to give every SM `programs_per_sm` programs, but none shorter than `min_chunk`
    keys. Short lists (token selection) are latency-bound, so more and shorter chunks finish sooner.
    One-byte codes want more programs (PROGRAMS_PER_SM)."""
    want = math.ceil(programs_per_sm * num_sms / max(batch_kv_heads, 1))
    return max(1, min(want, math.ceil(max_length / min_chunk), 128))


def indexed_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                   lengths: torch.Tensor, num_splits: int, scale: float | None = None,
                   window: int | None = None, key_positions: torch.Tensor | None = None,
                   query_positions: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                   config: dict | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, dequant: str | None = None) -> torch.Tensor:
    """q [B, Hq, D] over the keys named by table [B, H, P] (int32) and lengths [B, H] (int32).

    k_cache, v_cache: one layer's pool [num_pages, page_size, D] (page_size 1 for slot lists).
    window: attend only to keys whose position is above query_position - window (sliding window);
    key_positions is the layer's position pool [num_pages, page_size], query_positions [B].
    Returns [B, Hq, D] in q's dtype (into `out` when given). config overrides the launch settings
    (block_n, num_warps, num_stages), for tuning.
    k_scale, v_scale: for int8 / fp8 caches, the fp32 scale of each slot, [num_pages, page_size].
    dequant: "cast" or "fp32" (docs/kernels.md#quantized-kv) instead of DEQUANT's choice for the cache dtype.
    """
    B, Hq, D = q.shape
    H = table.shape[1]
    G = Hq // H
    page = k_cache.shape[1]
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert table.dtype == torch.int32 and lengths.dtype == torch.int32 and table.stride(-1) == 1
    quantized = k_scale is not None
    if quantized:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.dtype == v_scale.dtype == torch.float32
        mode = _QUANT_MODE[dequant_mode(k_cache.dtype, q.dtype, dequant)]
    else:
        k_scale = v_scale = lengths  # unused
        mode = 0
    out = torch.empty_like(q) if out is None else out
    scale = D**-0.5 if scale is None else scale
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_G = max(16, triton.next_power_of_2(G))
    if num_splits > 1:
        if workspace is None:
            workspace = (torch.empty(B * Hq * num_splits * D, device=q.device, dtype=torch.float32),
                         torch.empty(B * Hq * num_splits, device=q.device, dtype=torch.float32))
        part, lse = workspace
    else:
        part = lse = out  # unused
    has_window = window is not None
    key_pos = key_positions if has_window else lengths
    query_pos = query_positions if has_window else lengths
    launch = {**(QUANT_CONFIG[k_cache.dtype] if quantized else DEFAULT_CONFIG), **(config or {})}
    if D > 128:
        launch["block_n"] = min(launch["block_n"], 32)
    _decode_chunk[(B * H, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, table, lengths, key_pos, query_pos, out, part, lse,
        q.stride(0), q.stride(1), table.stride(0), table.stride(1), lengths.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, window or 0, num_splits,
        H=H, G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, PAGE=page, BLOCK_N=launch["block_n"],
        SPLIT=num_splits > 1, HAS_WINDOW=has_window, QUANT=mode, FP8=k_cache.dtype == torch.float8_e4m3fn,
        # fp32 stays fp32: tensor cores would round the inputs to TF32 (4e-4 relative error).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # fp32 tiles of a half-precision model's query and codes: TF32 holds them exactly.
        PRECISION32="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl.launch_options(q.device, early=True),
    )
    if num_splits > 1:
        _merge_chunks[(B * Hq,)](part, lse, out, out.stride(0), out.stride(1), num_splits, Hq=Hq, D=D,
                                 BLOCK_D=BLOCK_D, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
                                 **pdl.launch_options(q.device, early=True))
    return out
