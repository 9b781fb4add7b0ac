"""Quantized KV (turnkv/kv/quant.py, PagePool(kv_dtype=...)): error bounds per dtype, the pool's byte
accounting by number, reads that dequantize, eviction's compaction moving scales with the codes,
exports that put codes and scales back bit for bit, requantization of dequantized rows, and the
kv_dtype names of recipes and engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.errors import InvalidRequestError
from turnkv.kv import quant
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.snapshot import export_kv, import_kv
from turnkv.kv.snapshot import slots_of as seq_slots

FP8 = torch.float8_e4m3fn
L, H, D, PS = 2, 2, 16, 4


def rows(n, d=D, seed=0, spread=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    if spread:  # rows of very different magnitudes: per-row scales must follow them
        x = x * torch.logspace(-3, 2, n)[:, None]
    return x


# ---- quantize / dequantize ----------------------------------------------------------------------

def test_int8_error_is_at_most_half_a_step_of_the_row_scale():
    x = rows(200)
    codes, scale = quant.quantize(x, torch.int8)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (200,)
    assert codes.abs().max() == 127 and (codes.abs().amax(1) == 127).all()  # each row's absmax maps to 127
    torch.testing.assert_close(scale, x.abs().amax(1) / 127)
    err = (quant.dequantize(codes, scale, torch.float32) - x).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all()
    # The bound is reached within a factor: int8 is not exact.
    assert (err.amax(1) > scale / 4).float().mean() > 0.9


def test_fp8_error_is_relative_with_a_subnormal_floor():
    x = rows(200)
    codes, scale = quant.quantize(x, FP8)
    assert codes.dtype == FP8
    torch.testing.assert_close(scale, x.abs().amax(1) / 448)
    assert codes.float().abs().amax(1).eq(448).all()
    err = (quant.dequantize(codes, scale, torch.float32) - x).abs()
    bound = x.abs() / 16 + scale[:, None] * 2**-10
    assert (err <= bound * (1 + 1e-5)).all()
    assert err.max() > 0


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_zero_rows_and_dequantized_dtypes(dtype):
    x = rows(6)
    x[2] = 0
    codes, scale = quant.quantize(x.to(torch.bfloat16), dtype)
    assert scale[2] == 0 and (codes[2].float() == 0).all()
    out = quant.dequantize(codes, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and (out[2] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_requantizing_dequantized_rows_gives_the_same_codes(dtype, compute):
    """Rows dequantized into the compute dtype and quantized again (a Krul pair restored through
    PagePool.write, a state stored by a full-precision export) come back as the same codes, and
    scales within the compute dtype's rounding."""
    x = rows(500, seed=1, spread=False) * torch.rand(500, 1) * 10
    codes, scale = quant.quantize(x.to(compute), dtype)
    again, scale2 = quant.quantize(quant.dequantize(codes, scale, compute), dtype)
    assert torch.equal(again.view(torch.uint8) if dtype == FP8 else again,
                       codes.view(torch.uint8) if dtype == FP8 else codes)
    eps = torch.finfo(compute).eps
    torch.testing.assert_close(scale2, scale, rtol=eps, atol=0)


def test_kv_dtype_names_and_errors():
    assert quant.kv_dtype_name(None) == "none"
    assert quant.kv_dtype_name("INT8") == "int8" and quant.kv_dtype_name(torch.int8) == "int8"
    assert quant.kv_dtype_name("fp8_e4m3") == quant.kv_dtype_name(FP8) == "fp8"
    assert quant.kv_dtype_name("full") == "none"
    with pytest.raises(InvalidRequestError, match="int8, fp8, none"):
        quant.kv_dtype_name("int4")
    with pytest.raises(InvalidRequestError, match="not supported"):
        quant.kv_dtype_name(torch.float16)


# ---- the pool -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv, compute, per_token_head", [
    (None, torch.bfloat16, 2 * 16 * 2),  # K + V rows of 16 bf16
    (None, torch.float32, 2 * 16 * 4),
    ("int8", torch.bfloat16, 2 * 16 + 2 * 4),  # K + V rows of 16 bytes, and an fp32 scale each
    ("fp8", torch.float32, 2 * 16 + 2 * 4),
])
def test_bytes_accounting_counts_codes_and_scales(kv, compute, per_token_head):
    pool = PagePool(L, H, D, 8, PS, dtype=compute, kv_dtype=kv)
    assert pool.token_bytes == per_token_head == PagePool.token_head_bytes(D, compute, kv)
    assert pool.page_bytes == PS * per_token_head
    assert pool.capacity_bytes() == L * 8 * PS * per_token_head
    # ... which is what the tensors behind it take
    tensors = [pool.k, pool.v] + ([pool.k_scale, pool.v_scale] if kv else [])
    assert sum(t.numel() * t.element_size() for t in tensors) == pool.capacity_bytes()
    seq = SequenceKV(pool)
    seq.reserve(6)  # 2 pages per (layer, head)
    assert seq.bytes() == pool.bytes_in_use() == L * H * 2 * PS * per_token_head
    assert seq.bytes_per_head().tolist() == [[2 * PS * per_token_head] * H] * L


def test_int8_pool_holds_about_twice_the_tokens_of_bf16_in_the_same_bytes():
    from types import SimpleNamespace

    config = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    budget = 1 << 30
    bf16 = PagePool.for_budget(config, budget, 16, torch.bfloat16, "cpu")
    int8 = PagePool.for_budget(config, budget, 16, torch.bfloat16, "cpu", kv_dtype="int8")
    assert int8.page_bytes == 16 * (2 * 128 + 8) and bf16.page_bytes == 16 * 512
    assert int8.num_pages == budget // (32 * 16 * 264) and int8.capacity_bytes() <= budget
    assert int8.num_pages / bf16.num_pages == pytest.approx(512 / 264, rel=1e-3)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_writes_quantize_and_reads_dequantize(kv):
    pool = PagePool(L, H, D, 8, PS, dtype=torch.float32, kv_dtype=kv)
    assert pool.k.dtype == pool.kv_dtype == quant.storage_dtype(kv) and pool.dtype == torch.float32
    x, y = rows(10, seed=2), rows(10, seed=3)
    slots = torch.tensor([0, 1, 2, 5, 9, 12, 13, 20, 30, 31])
    pool.write(1, slots, x, y)
    kc, ks = quant.quantize(x, pool.kv_dtype)
    assert torch.equal(quant.raw(pool.k[1]).view(-1, D)[slots], quant.raw(kc)) and torch.equal(pool.k_scale[1].view(-1)[slots], ks)
    want_k, want_v = (quant.round_trip(t, pool.kv_dtype) for t in (x, y))
    assert torch.equal(pool.rows(1, slots, "k"), want_k) and torch.equal(pool.rows(1, slots, "v"), want_v)
    assert torch.equal(pool.round_trip(x), want_k)
    table = torch.tensor([[[0, 1, 2], [5, 7, 3]]])  # pages; head 0 holds slots 0..9 of pages 0, 1, 2
    got = pool.gather(1, table, 10, "k")[0, 0]
    flat = torch.arange(10)
    expect = torch.zeros(10, D)
    expect[torch.isin(flat, slots)] = want_k[torch.isin(slots, flat)]
    assert torch.equal(got, expect)
    assert torch.equal(pool.pages(1, torch.tensor([0, 1]), "v").reshape(-1, D)[:3], want_v[:3])
    # Layer 0 untouched; never-written slots read as zeros (scale 0), finite.
    assert torch.count_nonzero(pool.k_scale[0]) == 0 and torch.isfinite(pool.gather(0, table, 10, "v")).all()


def test_exported_codes_go_back_bit_for_bit_and_into_any_pool():
    src = PagePool(L, H, D, 8, PS, dtype=torch.bfloat16, kv_dtype="int8")
    x, y = rows(7, seed=4).bfloat16(), rows(7, seed=5).bfloat16()
    slots = torch.arange(3, 10)
    src.write(0, slots, x, y)
    stored = src.export_rows(0, slots)
    assert set(stored) == {"k", "v", "k_scale", "v_scale"} and stored["k"].dtype == torch.int8
    dst = PagePool(L, H, D, 8, PS, dtype=torch.bfloat16, kv_dtype="int8")
    dst.write(0, slots + 4, **stored)
    for kind in ("k", "v"):
        assert torch.equal(dst.export_rows(0, slots + 4)[kind], stored[kind])
        assert torch.equal(dst.export_rows(0, slots + 4)[f"{kind}_scale"], stored[f"{kind}_scale"])
    # Into a pool of another storage: dequantized (then requantized as that pool stores).
    full = PagePool(L, H, D, 8, PS, dtype=torch.bfloat16)
    full.write(0, slots, **stored)
    assert torch.equal(full.rows(0, slots, "k"), src.rows(0, slots, "k"))
    fp8 = PagePool(L, H, D, 8, PS, dtype=torch.bfloat16, kv_dtype="fp8")
    fp8.write(0, slots, **stored)
    assert torch.equal(fp8.rows(0, slots, "v"), quant.round_trip(src.rows(0, slots, "v"), FP8))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_eviction_compaction_moves_scales_with_the_codes(kv):
    pool = PagePool(L, H, D, 32, PS, dtype=torch.float32, kv_dtype=kv)
    seq = SequenceKV(pool)
    n = 13
    slots = seq.reserve(n)  # [L, H, n]
    data = {}
    for layer in range(L):
        k, v = rows(H * n, seed=10 + layer), rows(H * n, seed=20 + layer)
        pool.write(layer, slots[layer].reshape(-1), k, v)
        data[layer] = (quant.round_trip(k, pool.kv_dtype).view(H, n, D), quant.round_trip(v, pool.kv_dtype).view(H, n, D))
    keep = [torch.tensor([0, 3, 4, 11, 12]), torch.tensor([1, 2, 5, 6, 7, 8, 9])]
    free_before = pool.free_pages(1)
    seq.keep(1, keep)
    assert pool.free_pages(1) == free_before + (4 - 2) + (4 - 2)  # 13 tokens in 4 pages -> 5 and 7 in 2
    k, v, pos = seq.gather(1)
    for h, idx in enumerate(keep):
        m = len(idx)
        assert torch.equal(k[h, :m], data[1][0][h, idx]) and torch.equal(v[h, :m], data[1][1][h, idx])
        assert pos[h, :m].tolist() == idx.tolist()
    k0, v0, _ = seq.gather(0)  # the other layer did not move
    assert torch.equal(k0, data[0][0]) and torch.equal(v0, data[0][1])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_snapshot_round_trip_is_exact_and_stores_codes(kv):
    pool = PagePool(L, H, D, 32, PS, dtype=torch.float32, kv_dtype=kv)
    seq = SequenceKV(pool)
    slots = seq.reserve(11)
    for layer in range(L):
        pool.write(layer, slots[layer].reshape(-1), rows(H * 11, seed=layer), rows(H * 11, seed=5 + layer))
    seq.keep(0, [torch.tensor([0, 2, 9]), torch.arange(11)])  # uneven heads
    meta, tensors = export_kv(seq)
    assert tensors["k.0"].dtype == pool.kv_dtype and tensors["k_scale.0"].shape == (3 + 11,)
    stored = sum(t.numel() * t.element_size() for name, t in tensors.items() if name[0] in "kv")
    assert stored == int(seq.lengths.sum()) * pool.token_bytes  # codes and scales, nothing more
    other = SequenceKV(pool)
    import_kv(other, meta, tensors)
    assert np.array_equal(seq.lengths, other.lengths)
    for layer in range(L):
        a, b = seq.gather(layer), other.gather(layer)
        for h, n in enumerate(seq.lengths[layer]):  # (past a head's length: padding)
            assert all(torch.equal(x[h, :n], y[h, :n]) for x, y in zip(a, b))
        assert all(torch.equal(x, y) for x, y in zip(pool.export_rows(layer, seq_slots(seq, layer)).values(),
                                                      pool.export_rows(layer, seq_slots(other, layer)).values()))


# ---- recipes and engines ------------------------------------------------------------------------

def test_recipe_key_parses_prints_and_rejects_unknown_names():
    from turnkv.methods.recipe import Recipe

    r = Recipe.parse("snapkv budget=256 kv_dtype=int8")
    assert r.kv_dtype == "int8" and r.evict.budget == 256
    assert "kv_dtype=int8" in str(r) and Recipe.parse(str(r)).kv_dtype == "int8"
    assert Recipe.parse("kv_dtype=fp8_e4m3").kv_dtype == "fp8" and Recipe().kv_dtype is None
    assert Recipe.from_dict({"preset": "snapkv", "kv_dtype": "fp8"}).kv_dtype == "fp8"
    with pytest.raises(InvalidRequestError, match="unknown kv_dtype 'int3'; choose one of: int8, fp8, none"):
        Recipe.parse("snapkv kv_dtype=int3")


def test_engine_builds_its_pool_from_the_recipe_and_refuses_other_kv_dtypes(chat_model_dir):
    import turnkv

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", recipe="snapkv budget=64 kv_dtype=int8")
    assert llm.pool.kv_dtype == torch.int8 and llm.info()["kv_dtype"] == "int8"
    assert llm.info()["kv_bytes_per_token"] == 2 * 2 * (2 * 16 + 8)  # layers x kv heads x (K+V codes + scales)
    conv = llm.conversation()  # the engine's recipe
    assert conv.recipe.kv_dtype == "int8"
    llm.conversation(recipe="h2o budget=32").close()  # no kv_dtype: any pool
    with pytest.raises(InvalidRequestError, match="kv_dtype=fp8.*kv_dtype=int8"):
        llm.conversation(recipe="snapkv kv_dtype=fp8")
    full = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB")
    assert full.pool.kv_dtype == torch.float32 and not full.pool.quantized
    with pytest.raises(InvalidRequestError, match="kv_dtype=int8, but this engine's KV pool holds kv_dtype=none"):
        full.conversation(recipe="kv_dtype=int8")
    with pytest.raises(InvalidRequestError, match="kv_dtype=int8"):
        full.generate([5, 6, 7], recipe="kv_dtype=int8", max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="disagree"):
        turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", kv_dtype="fp8", recipe="kv_dtype=int8")
    with pytest.raises(InvalidRequestError, match="choose one of"):
        turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", kv_dtype="int4")
