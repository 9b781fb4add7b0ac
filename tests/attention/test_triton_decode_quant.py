"""The indexed decode kernel over int8 / fp8 pages with per-slot scales, against the reference path
(gather the codes, dequantize, attend): page tables and slot lists, uneven lengths, GQA, split-K,
sliding windows, every output element written. On CPU in Triton's interpreter at small shapes, with
fp32 / fp16 compute (the interpreter does not compute bf16 dots correctly); on a GPU bf16 too.
Also the LoopServe window-score kernel over quantized keys."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import reference  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from turnkv.attention.triton.decode import codes_to_f32, indexed_decode, int8_to_f16  # noqa: E402
from turnkv.kv import quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1e-4), (torch.float16, 2e-3)] + ([(torch.bfloat16, 1e-2)] if DEVICE == "cuda" else [])
KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# "f16asm" is inline PTX: a GPU only (elsewhere indexed_decode runs "cast" in its place).
DEQUANTS = ["cast", "fp32"] + (["f16asm"] if DEVICE == "cuda" else [])


def _skip_unsupported(kv, dequant):
    if dequant == "f16asm" and kv != "int8":
        pytest.skip("f16asm dequantizes int8 codes only")


def _case(B, H, G, D, page_size, num_pages, lengths, kv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Per-row magnitudes spread over 3 decades: the scales matter.
    mag = torch.logspace(-1.5, 1.5, num_pages * page_size)[torch.randperm(num_pages * page_size, generator=gen)]
    k = torch.randn(num_pages * page_size, D, generator=gen) * mag[:, None]
    v = torch.randn(num_pages * page_size, D, generator=gen) * mag.flip(0)[:, None]
    (kc, ks), (vc, vs) = quant.quantize(k, KV[kv]), quant.quantize(v, KV[kv])
    pages = dict(k=kc.view(num_pages, page_size, D), v=vc.view(num_pages, page_size, D),
                 k_scale=ks.view(num_pages, page_size), v_scale=vs.view(num_pages, page_size))
    pages = {name: t.to(DEVICE) for name, t in pages.items()}
    q = torch.randn(B, H * G, D, generator=gen).to(DEVICE, dtype)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE).view(B, H)
    width = -(-int(lengths.max()) // page_size)
    table = torch.randperm(num_pages, generator=gen)[: B * H * width].view(B, H, width).to(DEVICE, torch.int32)
    return q, pages, table, lengths


def _relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("G,D", [(1, 32), (3, 64), (4, 64)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_quantized_pages_with_uneven_lengths(kv, dequant, dtype, tol, G, D, splits):
    _skip_unsupported(kv, dequant)
    B, H, ps = 2, 2, 4
    q, p, table, lengths = _case(B, H, G, D, ps, 64, [1, 37, 64, 13], kv, dtype)
    ref = reference.indexed_decode(q.float(), p["k"], p["v"], table, lengths, k_scale=p["k_scale"],
                                   v_scale=p["v_scale"])
    out = torch.full_like(q, float("nan"))
    indexed_decode(q, p["k"], p["v"], table, lengths, splits, out=out, k_scale=p["k_scale"], v_scale=p["v_scale"],
                   dequant=dequant)
    assert not out.isnan().any(), "every output element must be written"
    assert _relative_error(out, ref) < tol


@pytest.mark.parametrize("kv", list(KV))
def test_reference_dequantizes_after_the_gather(kv):
    """The reference over codes + scales equals attention over the dequantized pool, and differs from
    attention over the unquantized rows by the quantization error only."""
    B, H, G, D, ps = 2, 2, 2, 32, 4
    q, p, table, lengths = _case(B, H, G, D, ps, 32, [9, 30, 17, 3], kv, torch.float32)
    deq_k = quant.dequantize(p["k"], p["k_scale"], torch.float32)
    deq_v = quant.dequantize(p["v"], p["v_scale"], torch.float32)
    ref = reference.indexed_decode(q, p["k"], p["v"], table, lengths, k_scale=p["k_scale"], v_scale=p["v_scale"])
    torch.testing.assert_close(ref, reference.indexed_decode(q, deq_k, deq_v, table, lengths), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_quantized_slot_lists(kv, dequant, dtype, tol):
    """Token selection: a table of single slots (page_size 1 views of the codes and of the scales)."""
    _skip_unsupported(kv, dequant)
    B, H, G, D, ps = 2, 2, 4, 64, 8
    q, p, _, _ = _case(B, H, G, D, ps, 32, [1, 1, 1, 1], kv, dtype)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(32 * ps, generator=gen)[: B * H * 50].view(B, H, 50).to(DEVICE, torch.int32)
    lengths = torch.tensor([[50, 7], [23, 1]], dtype=torch.int32, device=DEVICE)
    flat = dict(k=p["k"].view(-1, 1, D), v=p["v"].view(-1, 1, D), k_scale=p["k_scale"].view(-1, 1),
                v_scale=p["v_scale"].view(-1, 1))
    ref = reference.indexed_decode(q.float(), flat["k"], flat["v"], slots, lengths, k_scale=flat["k_scale"],
                                   v_scale=flat["v_scale"])
    out = torch.full_like(q, float("nan"))
    indexed_decode(q, flat["k"], flat["v"], slots, lengths, 4, out=out, k_scale=flat["k_scale"],
                   v_scale=flat["v_scale"], dequant=dequant)
    assert not out.isnan().any() and _relative_error(out, ref) < tol


@pytest.mark.parametrize("splits", [1, 4])
def test_quantized_sliding_window(splits):
    B, H, G, D, ps = 2, 2, 2, 32, 4
    q, p, table, lengths = _case(B, H, G, D, ps, 64, [30, 30, 17, 17], "int8", torch.float32)
    key_pos = torch.zeros(64, ps, dtype=torch.int64, device=DEVICE)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            slots = (table[b, h].long()[:, None] * ps + torch.arange(ps, device=DEVICE)).view(-1)[:n]
            key_pos.view(-1)[slots] = torch.arange(n, device=DEVICE)
    query_pos = (lengths[:, 0] - 1).long()
    scales = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    ref = reference.indexed_decode(q, p["k"], p["v"], table, lengths, window=8, key_positions=key_pos,
                                   query_positions=query_pos, **scales)
    full = reference.indexed_decode(q, p["k"], p["v"], table, lengths, **scales)
    assert _relative_error(full, ref) > 0.05
    out = indexed_decode(q, p["k"], p["v"], table, lengths, splits, window=8, key_positions=key_pos,
                         query_positions=query_pos, **scales)
    assert _relative_error(out, ref) < 1e-4


@triton.jit
def _convert(x_ptr, o_ptr, N: tl.constexpr, FP8: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, codes_to_f32(tl.load(x_ptr + i), FP8))


def test_codes_to_fp32_by_bit_arithmetic_is_exact_for_every_code():
    every = {"int8": torch.arange(-128, 128, dtype=torch.int16).to(torch.int8),
             "fp8": torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)}
    for kv, codes in every.items():
        out = torch.empty(256, device=DEVICE)
        _convert[(1,)](codes.to(DEVICE), out, N=256, FP8=kv == "fp8")
        want = codes.float().to(DEVICE)
        finite = ~want.isnan()  # (e4m3's two NaN codes are never stored: codes are clamped to 448)
        assert torch.equal(out[finite], want[finite]), kv


@triton.jit
def _convert_f16(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, int8_to_f16(tl.load(x_ptr + i)))


@pytest.mark.skipif(DEVICE != "cuda", reason="inline PTX: needs CUDA")
def test_int8_to_fp16_by_byte_permutes_is_exact_for_every_code_in_order():
    # Every code at every position of a 4-code register, so a swapped byte order would show.
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).repeat(4)
    codes = torch.cat([codes, codes.roll(1), codes.roll(2), codes.roll(3)]).to(DEVICE)
    out = torch.empty(codes.numel(), dtype=torch.float16, device=DEVICE)
    _convert_f16[(1,)](codes, out, N=codes.numel())
    assert torch.equal(out, codes.half())


def test_dispatcher_passes_the_scales_to_the_reference_off_cuda():
    from turnkv.attention import decode

    q, p, table, lengths = _case(1, 2, 2, 16, 4, 16, [5, 9], "fp8", torch.float32)
    got = decode.indexed_decode(q, p["k"], p["v"], table, lengths, k_scale=p["k_scale"], v_scale=p["v_scale"])
    want = reference.indexed_decode(q, p["k"], p["v"], table, lengths, k_scale=p["k_scale"], v_scale=p["v_scale"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", list(KV))
def test_window_score_kernel_over_quantized_keys(kv):
    from turnkv.attention.triton import window_scores as kernel
    from turnkv.methods.loopserve.decode import window_scores

    gen = torch.Generator().manual_seed(3)
    B, H, G, D, ps, P, W = 2, 2, 2, 16, 8, 12, 6
    pages = B * H * P
    codes, scale = quant.quantize(torch.randn(pages * ps, D, generator=gen) * 3, KV[kv])
    k_pool, k_scale = codes.view(pages, ps, D), scale.view(pages, ps)
    table = torch.randperm(pages, generator=gen).view(B, H, P).to(torch.int32)
    lengths = torch.tensor([[P * ps - 5, 40], [1, 77]], dtype=torch.int32)
    kpos_pool = torch.zeros(pages, ps, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            j = torch.arange(n)
            kpos_pool.view(-1)[table[b, h, j // ps].long() * ps + j % ps] = j
    last = torch.tensor([P * ps - 6, 76])
    qpos = last[:, None] - torch.arange(W - 1, -1, -1)
    q = torch.randn(B, W, H * G, D, generator=gen)
    cap = P * ps
    # The kernel reads device tensors (CUDA, or the interpreter's CPU ones); the torch reference runs on the CPU.
    on = [t.to(DEVICE) for t in (q, qpos, k_pool, kpos_pool, table, lengths, k_scale)]
    got = kernel.window_scores(*on[:6], cap, num_splits=3, block_n=16, k_scale=on[6]).cpu()
    want = window_scores(q, qpos, k_pool, kpos_pool, table, lengths, cap, k_scale=k_scale)
    deq = window_scores(q, qpos, quant.dequantize(k_pool, k_scale, torch.float32), kpos_pool, table, lengths, cap)
    assert torch.equal(want, deq)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and finite.sum() > 100
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-4)
