"""Every Triton kernel of turnkv, launched as the engine launches it on an H100: the cases that
sm90.py compiles for sm_90 (test_sm90_compile.py runs them).

Each case calls the kernel's Python wrapper (the engine's own launch settings, constexprs and
device-dependent choices) on CPU tensors of an engine shape; torch.empty leaves them unwritten, since
nothing runs. Shapes are Llama-3.1-8B's and SmolLM2-135M's (the embedded model), both in bf16, the
engine's dtype on CUDA, with the pool's 16-token pages and its int8 / fp8 quantized variants. Where a
constexpr follows a runtime size (split counts, top-k widths), a case takes the value the engine
derives for a 32K or 128K context. A variant the engine never reaches on an H100 is still compiled
when a setting selects it (PDL off, fp16 / fp32 models, the 'fp32' dequantization, split-K): its
comment says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch

from turnkv.attention.triton import (
    chunk_prefill,
    decode,
    diagonals,
    greedy,
    lines,
    lse_merge,
    page_fold,
    page_select,
    radix_top_k,
    token_slots,
    top_k,
    window_scores,
)
from turnkv.kv import head_write, quant_write
from turnkv.model.triton import activation, gemv, norm, pdl, rope

BF16, FP16, FP32, INT8, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn
I32, I64 = torch.int32, torch.int64
PAGE = 16  # the pool's page size (LLM's default)
SMS = 132  # an H100 SXM's SMs


@dataclass(frozen=True)
class Model:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


MODELS = {"llama8b": Model(4096, 32, 8, 128, 14336, 128256), "smollm2": Model(576, 9, 3, 64, 1536, 49152)}
CASES = {}


def case(name):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = fn
        return fn
    return register


def e(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


def z(*shape, dtype=I32):
    return torch.zeros(*shape, dtype=dtype)


def pdl_off():
    """TURNKV_PDL=0, or a GPU below compute capability 9: the kernels without griddepcontrol."""
    return mock.patch.object(pdl, "ENABLED", False)


# ---- the decoder's kernels (model/triton) ------------------------------------------------------------

def _projections(m: Model):
    """(N, K) of each decoder projection: fused q/k/v, o_proj, fused gate/up, down_proj, lm_head."""
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    return [(qkv, m.hidden), (m.hidden, m.heads * m.head_dim), (2 * m.intermediate, m.hidden),
            (m.hidden, m.intermediate), (m.vocab, m.hidden)]


def _skinny(m: Model, rows: int, dtype=BF16, bias=False, config=None):
    for N, K in _projections(m):
        x = e(rows, K, dtype=dtype)
        if K == m.intermediate:  # down_proj reads the strided gate half of gate/up's output
            x = e(rows, 2 * K, dtype=dtype)[:, :K]
        gemv.skinny_matmul(x, e(N, K, dtype=dtype), e(N, dtype=dtype) if bias else None, config=config)


for _name, _m in MODELS.items():
    # Decode: M = 1 takes M1_CONFIG; 2..8 rows (ops.SKINNY_MAX_ROWS) share MULTI_ROW_CONFIG's kernel.
    case(f"skinny_matmul/{_name}/M1")(lambda m=_m: _skinny(m, 1))
    case(f"skinny_matmul/{_name}/M4")(lambda m=_m: _skinny(m, 4))


@case("skinny_matmul/qwen2-bias/M1+M4")
def _skinny_bias():
    # Qwen2's q/k/v carry a bias (HAS_BIAS).
    m = Model(896, 14, 2, 64, 4864, 151936)
    _skinny(m, 1, bias=True)
    _skinny(m, 4, bias=True)


@case("skinny_matmul/split_k+fp16+fp32+pdl_off")
def _skinny_other():
    # Split-K: default_config's choice when a projection has fewer tiles than the SMs.
    x, w = e(4, 4096), e(512, 4096)
    gemv.skinny_matmul(x, w, config=dict(split_k=4))
    gemv.skinny_matmul(e(1, 4096), w, config=dict(split_k=4))
    gemv.skinny_matmul(e(1, 4096, dtype=FP16), e(4096, 4096, dtype=FP16))
    gemv.skinny_matmul(e(4, 4096, dtype=FP16), e(4096, 4096, dtype=FP16))
    gemv.skinny_matmul(e(4, 4096, dtype=FP32), e(4096, 4096, dtype=FP32))  # fp32: ieee dot
    with pdl_off():
        gemv.skinny_matmul(e(1, 4096), e(4096, 4096))
        gemv.skinny_matmul(e(4, 4096), e(4096, 4096))


@case("add_rms_norm")
def _norm():
    for m in MODELS.values():
        for rows in (1, 512):  # decode, prefill
            norm.add_rms_norm(e(rows, m.hidden), e(rows, m.hidden), e(m.hidden), 1e-5)
    norm.add_rms_norm(e(1, 16384), e(1, 16384), e(16384), 1e-5)  # rows wider than MAX_TILE loop
    with pdl_off():
        norm.add_rms_norm(e(1, 4096), e(1, 4096), e(4096), 1e-5)


@case("rope")
def _rope():
    for m in MODELS.values():
        heads = m.heads + 2 * m.kv_heads
        for B, T in ((4, 1), (1, 512)):  # decode, prefill: q and k heads rotated in place
            rope.rope_in_place(e(B, T, heads, m.head_dim), m.heads + m.kv_heads, e(1, T, 1, m.head_dim),
                               e(1, T, 1, m.head_dim))
        B = 4  # the graphed decode step: rotation and the stores into the pool's pages
        rope.rope_store(e(B, 1, heads, m.head_dim), m.heads, e(B, 1, 1, m.head_dim), e(B, 1, 1, m.head_dim),
                        e(B, m.heads, m.head_dim), z(B * m.kv_heads), e(64, PAGE, m.head_dim),
                        e(64, PAGE, m.head_dim))
    with pdl_off():
        rope.rope_in_place(e(1, 1, 48, 128), 40, e(1, 1, 1, 128), e(1, 1, 1, 128))
        rope.rope_store(e(1, 1, 48, 128), 32, e(1, 1, 1, 128), e(1, 1, 1, 128), e(1, 32, 128), z(8),
                        e(64, PAGE, 128), e(64, PAGE, 128))


@case("silu_mul")
def _silu():
    for m in MODELS.values():
        activation.silu_mul_in_place(e(1, 2 * m.intermediate), m.intermediate)
    with pdl_off():
        activation.silu_mul_in_place(e(1, 2 * 14336), 14336)


# ---- the KV pool's writes (kv/) ----------------------------------------------------------------------

@case("write_heads")
def _write_heads():
    for m in MODELS.values():
        for B, T in ((4, 1), (1, 512)):  # decode, prefill
            kv = e(B, T, 2 * m.kv_heads, m.head_dim)
            head_write.write_heads(kv[:, :, : m.kv_heads], kv[:, :, m.kv_heads :], z(B * m.kv_heads * T),
                                   e(64, PAGE, m.head_dim), e(64, PAGE, m.head_dim))
    with pdl_off():
        head_write.write_heads(e(1, 1, 8, 128), e(1, 1, 8, 128), z(8), e(64, PAGE, 128), e(64, PAGE, 128))


@case("quantize_write")
def _quantize_write():
    for m in MODELS.values():
        for codes in (INT8, FP8):
            for rows in (4 * m.kv_heads, 512 * m.kv_heads):
                quant_write.quantize_write(e(rows, m.head_dim), e(rows, m.head_dim), z(rows, dtype=I64),
                                           e(64, PAGE, m.head_dim, dtype=codes), e(64, PAGE, m.head_dim, dtype=codes),
                                           e(64, PAGE, dtype=FP32), e(64, PAGE, dtype=FP32))


# ---- decode attention (attention/triton/decode.py) ---------------------------------------------------

def _decode(m: Model, B=1, length=32768, page=PAGE, codes=None, dtype=BF16, window=None, dequant=None):
    """indexed_decode over `length` keys per head, split as the engine splits them on an H100."""
    H, D = m.kv_heads, m.head_dim
    splits = decode.choose_splits(B * H, length, SMS, programs_per_sm=decode.PROGRAMS_PER_SM.get(codes, 4))
    pages = 64
    store = codes or dtype
    scales = dict(k_scale=e(pages, page, dtype=FP32), v_scale=e(pages, page, dtype=FP32)) if codes else {}
    windowed = dict(window=window, key_positions=z(pages, page, dtype=I64), query_positions=z(B, dtype=I64)) \
        if window else {}
    decode.indexed_decode(e(B, m.heads, D, dtype=dtype), e(pages, page, D, dtype=store), e(pages, page, D, dtype=store),
                          z(B, H, length // page), z(B, H), splits, dequant=dequant, **scales, **windowed)


for _name, _m in MODELS.items():
    case(f"decode/{_name}/paged")(lambda m=_m: (_decode(m), _decode(m, B=8, length=16384)))
    case(f"decode/{_name}/slots")(lambda m=_m: _decode(m, page=1, length=4096))  # token selection: page 1
    case(f"decode/{_name}/window")(lambda m=_m: _decode(m, window=4096))  # a model's sliding window
    case(f"decode/{_name}/int8")(lambda m=_m: _decode(m, codes=INT8))  # DEQUANT: "f16asm"
    case(f"decode/{_name}/fp8")(lambda m=_m: _decode(m, codes=FP8))  # DEQUANT: "cast"


@case("decode/llama8b/other")
def _decode_other():
    m = MODELS["llama8b"]
    _decode(m, codes=INT8, dequant="fp32")  # the 'fp32' dequantization (benchmarks/decode/gpu_kv_quant.py)
    _decode(m, codes=FP8, dequant="fp32")
    _decode(m, codes=INT8, dtype=FP16)  # an fp16 model: "f16asm" with an fp16 query
    _decode(m, dtype=FP32)  # an fp32 model: ieee dots, int8 by "cast"
    _decode(m, codes=INT8, dtype=FP32)
    with pdl_off():
        _decode(m)


# ---- paged chunk attention: later chunks and turns (attention/triton/chunk_prefill.py) ----------------

def _chunk(m: Model, T=512, history=131072, codes=None, dtype=BF16, window=None, B=1, sink=0):
    """chunk_attention of T new tokens over `history` kept ones per head, as Step launches it: q a view of
    the decoder's fused q/k/v rows, int64 tables and lengths, split as on an H100."""
    H, D = m.kv_heads, m.head_dim
    length = history + T
    block_m = chunk_prefill.launch_config(dtype, D)["block_m"]
    splits = chunk_prefill.choose_splits(B * H, -(-m.group * T // block_m), length, SMS)
    pages = 64
    store = codes or dtype
    scales = dict(k_scale=e(pages, PAGE, dtype=FP32), v_scale=e(pages, PAGE, dtype=FP32)) if codes else {}
    windowed = dict(window=window, key_positions=z(pages, PAGE, dtype=I64), query_positions=z(B, T, dtype=I64),
                    sink=sink) if window is not None else {}
    q = e(B, T, m.heads + 2 * H, D, dtype=dtype)[:, :, : m.heads].transpose(1, 2)
    chunk_prefill.chunk_attention(q, e(pages, PAGE, D, dtype=store), e(pages, PAGE, D, dtype=store),
                                  z(B, H, -(-length // PAGE), dtype=I64), z(B, H, dtype=I64), splits, **scales,
                                  **windowed)


for _name, _m in MODELS.items():
    # Turn k+1 (512 over 128K: split), a short turn (64: split further), a long chunk (4K: unsplit).
    case(f"chunk_prefill/{_name}")(lambda m=_m: (_chunk(m), _chunk(m, T=64), _chunk(m, T=4096)))
    case(f"chunk_prefill/{_name}/int8+fp8")(lambda m=_m: (_chunk(m, codes=INT8), _chunk(m, T=4096, codes=FP8)))
    case(f"chunk_prefill/{_name}/window")(lambda m=_m: (_chunk(m, window=4096), _chunk(m, T=4096, window=4096)))
    # LServe's streaming heads: a window per KV head and the sink (Step, with StreamingHeadsPrefill).
    case(f"chunk_prefill/{_name}/head windows")(lambda m=_m: (
        _chunk(m, T=2048, history=16384, window=z(m.kv_heads, dtype=I32), sink=128),
        _chunk(m, T=64, window=z(m.kv_heads, dtype=I32), sink=128)))


@case("chunk_prefill/llama8b/fp16+fp32")
def _chunk_other():
    m = MODELS["llama8b"]
    _chunk(m, dtype=FP16)  # an fp16 model
    _chunk(m, dtype=FP32)  # an fp32 model: FP32_CONFIG, ieee dots
    _chunk(m, T=4096, dtype=FP32, codes=INT8)


# ---- prefill line attention (attention/triton/lines.py) ----------------------------------------------

def _lines(m: Model, dtype=BF16, per_query_head=True, window=None, T=512):
    B, S = 1, T
    U = m.heads if per_query_head else m.kv_heads
    vertical = torch.zeros(B * U, S, dtype=torch.bool)
    vertical[:, :4] = True
    slash = torch.zeros(B * U, S, dtype=torch.bool)
    slash[:, :64] = True
    slash[:, 200] = True
    block_m = lines.block_m_for(dtype)
    plan = lines.Plan(vertical, slash, z(B), torch.full((B, m.kv_heads), S, dtype=I32), T, m.group, per_query_head,
                      window, block_m)
    lines.line_attention(e(B, m.heads, T, m.head_dim, dtype=dtype), e(B, m.kv_heads, S, m.head_dim, dtype=dtype),
                         e(B, m.kv_heads, S, m.head_dim, dtype=dtype), plan)


for _name, _m in MODELS.items():
    case(f"line_attention/{_name}")(lambda m=_m: (_lines(m), _lines(m, per_query_head=False)))
    case(f"line_attention/{_name}/window+fp32")(lambda m=_m: (_lines(m, window=256), _lines(m, dtype=FP32)))


# ---- decode-time selection (LServe, Quest, LoopServe) ------------------------------------------------

def _window_scores(m: Model, per_kv: bool, codes=None, capacity=32768, W=16, B=1):
    """LoopServe's re-selection score over a graph's capacity (W: its observation window)."""
    pages = capacity // PAGE
    k_scale = e(pages, PAGE, dtype=FP32) if codes else None
    window_scores.window_scores(e(B, W, m.heads, m.head_dim), z(B, W, dtype=I64),
                                e(pages, PAGE, m.head_dim, dtype=codes or BF16), z(pages, PAGE, dtype=I64),
                                z(B, m.kv_heads, pages), z(B, m.kv_heads), capacity, per_kv=per_kv, k_scale=k_scale)


for _name, _m in MODELS.items():
    case(f"window_scores/{_name}")(lambda m=_m: (_window_scores(m, False), _window_scores(m, True)))
    case(f"window_scores/{_name}/int8+fp8")(lambda m=_m: (_window_scores(m, False, INT8),
                                                          _window_scores(m, True, FP8)))


def _page_scores(m: Model, group: str, physical: int, logical: int, capacity=131072, B=1):
    pages = capacity // PAGE
    rows = pages * (PAGE // logical) + 1
    page_select.page_scores(e(B, m.heads, m.head_dim), e(rows, m.head_dim), e(rows, m.head_dim),
                            z(B, m.kv_heads, pages), z(B, m.kv_heads), capacity // physical, physical, logical,
                            PAGE, group)


for _name, _m in MODELS.items():
    # LServe: 64-token physical pages of 16-token logical ones; its three groupings. Quest: 16 / 16.
    case(f"page_scores/{_name}")(lambda m=_m: [_page_scores(m, g, 64, 16) for g in ("query", "max", "sum")]
                                 + [_page_scores(m, "query", 16, 16)])


@case("fold_keys+expand_pages")
def _page_tables():
    for m in MODELS.values():
        L, B = 2, 4
        page_select.fold_keys(e(L, 64, PAGE, m.head_dim), z(L, B, dtype=I64), e(L, 64 + 1, m.head_dim),
                              e(L, 64 + 1, m.head_dim), 16)
        # LServe at 128K: K = 4096 / 64 pages per row, 4 pool pages per physical page, rows per
        # query head ("query") or per KV head.
        K, r, P = 64, 4, 131072 // PAGE
        for R in (m.heads, m.kv_heads):
            chosen = z(L, B, R, K, dtype=I64)
            args = (chosen, z(L, B, m.kv_heads, dtype=I64), z(L, B, m.kv_heads, dtype=I64),
                    z(L, B, m.kv_heads, P), z(L, B, m.kv_heads), 0, 1, B, K, r, 64)
            page_select.expand_pages(*args, candidates=z(B, R, 4 * K, dtype=I64), refresh=z(L, B, dtype=I64))
            page_select.expand_pages(*args)


@case("fold_runs")
def _fold_runs():
    for m in MODELS.values():
        # A 32K-token chunk's keys as a view of the fused q/k/v projection, every head (Quest, LServe
        # without streaming heads) or the selecting ones; LServe's 16-token and Quest's 8-token pages.
        T = 32768
        fused = e(1, T, m.heads + 2 * m.kv_heads, m.head_dim)
        k = fused[:, :, m.heads : m.heads + m.kv_heads]
        rows = (T // PAGE + 1) * 2 + 1
        for logical in (16, 8):
            page_fold.fold_runs(k, z(1, m.kv_heads, T, dtype=I64), e(rows, m.head_dim), e(rows, m.head_dim), logical)
        page_fold.fold_runs(k, z(1, m.kv_heads, T, dtype=I64), e(rows, m.head_dim), e(rows, m.head_dim), 16,
                            z(m.kv_heads // 2, dtype=I64))


@case("lse_merge")
def _lse_merge():
    # A 32K prefill chunk's history and self attention merged into the step's [B, T, Hq, D] output.
    m = MODELS["llama8b"]
    T = 32768
    out = e(1, T, m.heads, m.head_dim).transpose(1, 2)
    lse_merge.merge(e(1, m.heads, T, m.head_dim), e(1, m.heads, T, dtype=FP32),
                    e(1, T, m.heads, m.head_dim).transpose(1, 2), e(1, m.heads, T, dtype=FP32), out)


@case("top_k")
def _top_k():
    for m in MODELS.values():
        # LServe: 32K and 128K of 64-token pages, k = 63; Quest at 32K: 2048 pages of 16, k = 255.
        top_k.top_k_ascending(e(m.heads, 512, dtype=FP32), 63)
        top_k.top_k_ascending(e(m.heads, 2048, dtype=FP32), 63)
        top_k.top_k_ascending(e(m.heads, 2048, dtype=FP32), 255)
        top_k.candidates(e(m.heads, 2048, dtype=FP32), 64)  # the graphed LServe selection's stage 1 (K = 64)


@case("radix_top_k")
def _radix_top_k():
    for m in MODELS.values():
        # LoopServe's re-selection: k = 1024 of 32K and 128K tokens.
        for n in (32768, 131072):
            radix_top_k.top_k_ascending(e(m.heads, n, dtype=FP32), 1024)


@case("commit_slots")
def _commit_slots():
    for m in MODELS.values():
        for R in (m.heads, m.kv_heads):  # LoopServe granularity "query" or "kv"
            B, K = 4, 1024
            token_slots.commit_slots(z(B, R, K, dtype=I64), z(B, m.kv_heads), z(B, m.kv_heads, 2048), z(B, dtype=I64),
                                     z(B, R, K + 32), 32768, PAGE)


# ---- LoopServe's prefill selection -------------------------------------------------------------------

@case("greedy+diagonal_sums")
def _greedy_diagonals():
    N, Ms, Mv = 32, 512, 512
    f, i = (lambda *s: e(*s, dtype=FP32)), (lambda *s: z(*s))
    for normalised in (True, False):
        greedy.greedy(f(N, Ms), f(N, Ms), f(N, Ms), i(N), f(N, Mv), f(N, Mv), f(N, Mv), i(N), f(N), i(N), i(N),
                      f(N), f(N), f(N), 1024, normalised)
    diagonals.diagonal_sums(e(32, 64, 4096, dtype=FP32), [list(range(4032, 4096))], 4096)

