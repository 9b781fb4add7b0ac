"""The paged chunk-attention kernel against the reference (gather the pages, dequantize, mask, SDPA):
several query and key blocks, GQA groups, uneven head lengths, partial last pages, split and unsplit
key ranges, int8 / fp8 pools with their scales, sliding windows, every output element written.
On CPU in Triton's interpreter at small shapes and tiles, with fp32 / fp16 queries (the interpreter
does not compute bf16 dots correctly); on a GPU also at the engine's tiles and Llama-3.1-8B's shape
in bf16 (marked gpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import chunk, reference  # noqa: E402
from turnkv.attention.triton.chunk_prefill import choose_splits, chunk_attention  # noqa: E402
from turnkv.kv import quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel at engine tiles")
# Interpreted tiles: several query blocks and key tiles at small shapes.
SMALL = dict(block_m=16, block_n=16, num_warps=2, num_stages=1)
KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def make_case(B, H, G, D, page, lengths, T, dtype, kv=None, num_pages=None, seed=0, device=DEVICE):
    """A pool holding uneven heads (lengths [B * H], the T new tokens last in each), page tables in
    shuffled page order, and the chunk's queries. Positions are entry indices with a per-head gap
    (evicted tokens) so a window differs from an entry count."""
    gen = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int32).view(B, H)
    width = -(-int(lengths_t.max()) // page)
    num_pages = num_pages or B * H * width + 3
    slots = num_pages * page
    # Per-row magnitudes over 2 decades: the scales of a quantized pool matter.
    mag = torch.logspace(-1, 1, slots)[torch.randperm(slots, generator=gen)]
    k = torch.randn(slots, D, generator=gen) * mag[:, None]
    v = torch.randn(slots, D, generator=gen) * mag.flip(0)[:, None]
    pool = {}
    if kv is None:
        pool["k"], pool["v"] = k.to(dtype).view(num_pages, page, D), v.to(dtype).view(num_pages, page, D)
    else:
        (kc, ks), (vc, vs) = quant.quantize(k, KV[kv]), quant.quantize(v, KV[kv])
        pool.update(k=kc.view(num_pages, page, D), v=vc.view(num_pages, page, D),
                    k_scale=ks.view(num_pages, page), v_scale=vs.view(num_pages, page))
    table = torch.randperm(num_pages, generator=gen)[: B * H * width].view(B, H, width).to(torch.int32)
    # Positions: head (b, h) keeps entry j at position j + gap before its last T entries, j + gap
    # + extra for them, so every head ends at the sequence's position count.
    end = int(lengths_t.max()) + 5
    positions = torch.zeros(num_pages, page, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            n = int(lengths_t[b, h])
            pos = torch.arange(n) + (end - n)
            j = torch.arange(n)
            positions.view(-1)[table[b, h, j // page].long() * page + j % page] = pos
    q_pos = torch.arange(end - T, end)[None].expand(B, T).contiguous()
    q = torch.randn(B, H * G, T, D, generator=gen).to(dtype)
    moved = {name: x.to(device) for name, x in pool.items()}
    return q.to(device), moved, table.to(device), lengths_t.to(device), positions.to(device), q_pos.to(device)


def run_both(case, splits, window=None, config=SMALL, dtype=None, sink=0):
    q, pool, table, lengths, positions, q_pos = case
    scales = {name: pool[name] for name in ("k_scale", "v_scale") if name in pool}
    windowed = {} if window is None else dict(window=window, key_positions=positions, query_positions=q_pos, sink=sink)
    ref = reference.paged_chunk(q.float(), pool["k"], pool["v"], table, lengths, **windowed, **scales)
    out = torch.full_like(q, float("nan"))
    chunk_attention(q, pool["k"], pool["v"], table, lengths, splits, out=out, config=config, **windowed, **scales)
    assert not out.isnan().any(), "every output element must be written"
    return out, ref


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_uneven_heads_partial_pages(dtype, G, splits):
    # Lengths not multiples of the page (4) nor of the key tile (16); one head holds only the chunk.
    B, H, T = 2, 2, 11
    case = make_case(B, H, G, 32, 4, [83, 11, 50, 97], T, dtype)
    out, ref = run_both(case, splits)
    assert relative_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("splits", [1, 4])
def test_quantized_pools(kv, splits):
    case = make_case(1, 2, 4, 32, 8, [130, 61], 9, torch.float32, kv=kv)
    out, ref = run_both(case, splits)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("kv", list(KV))
def test_quantized_pool_half_queries(kv):
    case = make_case(1, 2, 2, 32, 16, [75, 140], 20, torch.float16, kv=kv)
    out, ref = run_both(case, 2)
    assert relative_error(out, ref) < 2e-3


def test_long_chunk_many_query_blocks():
    """A chunk longer than its history: most key tiles lie on some block's diagonal."""
    case = make_case(1, 2, 2, 16, 4, [70, 45], 40, torch.float32)
    for splits in (1, 2):
        out, ref = run_both(case, splits)
        assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_sliding_window(splits):
    case = make_case(1, 2, 2, 32, 4, [90, 57], 13, torch.float32)
    for window in (8, 30, 200):
        out, ref = run_both(case, splits, window=window)
        assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_a_window_per_head_with_a_sink(splits):
    """LServe's streaming heads: one KV head sees its sink and a window, the other everything. The
    reference's mask is checked cell by cell first, then the kernel against it."""
    case = make_case(1, 2, 2, 32, 4, [90, 57], 13, torch.float32)
    q, pool, table, lengths, positions, q_pos = case
    windows = torch.tensor([10, 1 << 30], dtype=torch.int32, device=q.device)
    sink = 38  # head 0's first positions (its keys start at position 5 + 0: see make_case)
    out, ref = run_both(case, splits, window=windows, sink=sink)
    assert relative_error(out, ref) < 1e-5
    # The reference, by hand: per KV head, causal over its entries, and in head 0 only the keys at
    # positions < sink or within 10 of the row.
    S = int(lengths.max())
    keys = reference.gather_pages(pool["k"], table, S)
    values = reference.gather_pages(pool["v"], table, S)
    key_pos = reference.gather_pages(positions, table, S)
    G, T = q.shape[1] // 2, q.shape[2]
    for h in range(2):
        n = int(lengths[0, h])
        for t in range(T):
            seen = torch.arange(S, device=q.device) <= n - T + t
            if h == 0:
                seen &= (key_pos[0, h] > q_pos[0, t] - 10) | (key_pos[0, h] < sink)
            assert 0 < int(seen.sum()) < n or h == 1
            for hq in range(h * G, (h + 1) * G):
                w = (q[0, hq, t] @ keys[0, h].T * q.shape[-1] ** -0.5).masked_fill(~seen, float("-inf")).softmax(-1)
                torch.testing.assert_close(ref[0, hq, t], w @ values[0, h], rtol=1e-5, atol=1e-5)
    # A per-head window of "none" everywhere is the plain causal chunk.
    out, _ = run_both(case, splits, window=torch.full((2,), 1 << 30, dtype=torch.int32, device=q.device))
    assert relative_error(out, run_both(case, splits)[1]) < 1e-5


def test_more_splits_than_tiles():
    """Splits that get no keys write an empty partial, which the merge ignores."""
    case = make_case(1, 1, 2, 16, 4, [20], 5, torch.float32)
    out, ref = run_both(case, 8)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_left_padded_rows_leave_the_real_rows_as_they_were(splits):
    """The graphed prefill's layout (engine/graph_prefill.py): a chunk of T tokens run as T + pad rows,
    the real ones last. Row t sees entries j <= length - rows + t, so the real rows equal the chunk
    run alone, and a padding row that sees no entry (head 0 holds only the chunk) is zeros."""
    T, pad = 5, 11
    q, pool, table, lengths, _, _ = make_case(1, 2, 2, 16, 4, [T, 37], T, torch.float32)
    alone = chunk_attention(q, pool["k"], pool["v"], table, lengths, splits, config=SMALL)
    garbage = torch.randn(1, 4, pad, 16, generator=torch.Generator().manual_seed(1)).to(q.device)
    padded = torch.cat([garbage, q], dim=2)
    out = chunk_attention(padded, pool["k"], pool["v"], table, lengths, splits, config=SMALL)
    torch.testing.assert_close(out[:, :, pad:], alone, rtol=1e-5, atol=1e-5)
    assert relative_error(alone, reference.paged_chunk(q, pool["k"], pool["v"], table, lengths)) < 1e-5
    assert out[:, :2, :pad].eq(0).all()  # head 0's group: no entry below the chunk
    assert out[:, 2:, pad - 2 :].abs().sum() > 0  # head 1's padding rows see some of its 32 kept


def test_default_output_layout():
    """Without `out`, the result is a [B, Hq, T, D] view of a contiguous [B, T, Hq, D] tensor (what the
    decoder's o_proj reads)."""
    q, pool, table, lengths, _, _ = make_case(1, 2, 2, 16, 4, [30, 21], 6, torch.float32)
    out = chunk_attention(q, pool["k"], pool["v"], table, lengths, config=SMALL)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    ref = reference.paged_chunk(q, pool["k"], pool["v"], table, lengths)
    assert relative_error(out, ref) < 1e-5


def test_int64_tables_and_lengths():
    """The engine's tables and lengths are int64 on the device: the kernel reads them as they are."""
    q, pool, table, lengths, _, _ = make_case(1, 2, 2, 16, 4, [30, 21], 6, torch.float32)
    out = chunk_attention(q, pool["k"], pool["v"], table.long(), lengths.long(), 2, config=SMALL)
    ref = reference.paged_chunk(q, pool["k"], pool["v"], table, lengths)
    assert relative_error(out, ref) < 1e-5


def test_choose_splits():
    # Turn k+1 at Llama-3.1-8B's shape on 132 SMs: 512 new rows x 4 heads in 16 blocks of 128 rows,
    # 8 KV heads: 128 programs unsplit, two splits fill two per SM; a 64-token chunk has 2 blocks per
    # head and is split further.
    assert choose_splits(8, 16, 131072, 132) == 2
    assert choose_splits(8, 2, 131072, 132) == 16
    assert choose_splits(8, 2, 8192, 132) == 8  # no split shorter than MIN_SPLIT_KEYS keys
    assert choose_splits(8, 2, 2047, 132) == 1
    assert choose_splits(8, 128, 131072, 132) == 2  # a 4K chunk fills the GPU; two splits even it out


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_step_takes_the_kernel_when_enabled(monkeypatch, kv_dtype):
    """Step's later-chunk path through the kernel (forced on CPU) equals the reference path, uneven
    heads, a partial last page and quantized pools included."""
    from turnkv.engine.step import Step
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    L, H, G, D, page = 2, 2, 2, 16, 4
    pool = PagePool(L, H, D, 64, page_size=page, dtype=torch.float32, device=DEVICE, kv_dtype=kv_dtype)
    seq = SequenceKV(pool)
    gen = torch.Generator().manual_seed(1)

    def step(T, kernel):
        monkeypatch.setattr(chunk, "ENABLED", kernel)
        monkeypatch.setattr(chunk, "FORCE", kernel)
        slots = seq.reserve(T)
        positions = torch.arange(seq.next_position - T, seq.next_position, device=DEVICE)[None]
        return Step(pool, [seq], [slots], positions)

    def attend(s, T, q, k, v):
        return [s.attention(layer, q[layer], k[layer], v[layer]) for layer in range(L)]

    T0 = 13
    s0 = step(T0, False)
    q0, k0, v0 = (torch.randn(L, 1, T0, n, D, generator=gen).to(DEVICE) for n in (H * G, H, H))
    attend(s0, T0, q0, k0, v0)
    # Uneven heads: head 1 of layer 0 drops its first five entries (as a compression would).
    seq.keep(0, [torch.arange(T0), torch.arange(5, T0)])
    T = 6
    q, k, v = (torch.randn(L, 1, T, n, D, generator=gen).to(DEVICE) for n in (H * G, H, H))
    s_kernel = step(T, True)
    assert s_kernel.chunk_kernel
    got = attend(s_kernel, T, q, k, v)
    seq.truncate(seq.next_position - T)
    s_ref = step(T, False)
    assert not s_ref.chunk_kernel
    want = attend(s_ref, T, q, k, v)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {"sliding_window": 8})])
def test_later_chunks_and_turns_match_transformers(tmp_path, monkeypatch, family, overrides):
    """A tiny model prefilled in chunks of 8 over two turns, with the kernel forced on, gives
    transformers' logits of the whole sequence at once (a sliding window included)."""
    from tests.conftest import two_turn_logits
    from turnkv.attention.triton import chunk_prefill

    calls = []
    launch = chunk_prefill.chunk_attention
    monkeypatch.setattr(chunk_prefill, "chunk_attention", lambda *a, **k: calls.append(a[0].shape) or launch(*a, **k))
    monkeypatch.setattr(chunk, "ENABLED", True)
    monkeypatch.setattr(chunk, "FORCE", True)
    ours, ref, c = two_turn_logits(tmp_path, family, DEVICE, **overrides)
    # Every chunk after the first; with a window the first too (Step's fresh path has no window).
    assert len(calls) == (5 if c.sliding_window else 4) * c.num_layers
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


# ---- the GPU lane: engine tiles, bf16 ---------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
@pytest.mark.parametrize("T,history", [(64, 4000), (512, 3001), (700, 700)])
def test_engine_tiles_bf16(kv, T, history):
    """Llama-3.1-8B's heads (32 / 8, D 128), 16-token pages, uneven heads, the engine's split choice."""
    H, G = 8, 4
    lengths = [history + T - 37 * h for h in range(H)]
    case = make_case(1, H, G, 128, 16, lengths, T, torch.bfloat16, kv=kv)
    blocks = -(-G * T // 128)
    splits = choose_splits(H, blocks, max(lengths), torch.cuda.get_device_properties(0).multi_processor_count)
    for s in sorted({1, splits, 4}):
        out, ref = run_both(case, s, config=None)
        assert relative_error(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@CUDA
def test_engine_tiles_window_bf16():
    case = make_case(1, 8, 4, 128, 16, [2000 - 11 * h for h in range(8)], 300, torch.bfloat16)
    out, ref = run_both(case, 3, window=1024, config=None)
    assert relative_error(out, ref) < TOL[torch.bfloat16]
