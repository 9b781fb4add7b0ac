"""The paged chunk kernel's ring iterator (LServe's block-sparse prefill): heads in ring form (a sink,
then a run of consecutive positions ending at the newest) visit only their sink's and window's tiles,
and equal the reference's masked attention by position. Heads without a window, a head subset
(the others' rows untouched), splits, quantized pools, sinks longer than what a head keeps, windows
wider than the history. On CPU in Triton's interpreter at small tiles; at the engine's tiles in bf16
on a GPU (marked gpu)."""

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
from turnkv.attention.triton.chunk_prefill import chunk_attention  # noqa: E402
from turnkv.kv import quant  # noqa: E402
from turnkv.methods.protocols import NO_WINDOW  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel at engine tiles")
SMALL = dict(block_m=16, block_n=16, num_warps=2, num_stages=1)
KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def ring_case(B, H, G, D, page, kept, T, N, sink, dtype, kv=None, seed=0):
    """Heads in ring form: kept[b][h] entries before the chunk, the first min(sink, n) at positions
    0.., the rest a run ending right before the chunk's T tokens (the sequence's positions end at
    N); pages shuffled. Returns q, pool dict, table, lengths, positions, query positions."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(kept, dtype=torch.int32).view(B, H) + T
    width = -(-int(lengths.max()) // page)
    num_pages = B * H * width + 2
    slots = num_pages * page
    k = torch.randn(slots, D, generator=gen)
    v = torch.randn(slots, D, generator=gen)
    pool = {}
    if kv is None:
        pool["k"], pool["v"] = k.to(dtype).view(num_pages, page, D), v.to(dtype).view(num_pages, page, D)
    else:
        (kc, ks), (vc, vs) = quant.quantize(k, KV[kv]), quant.quantize(v, KV[kv])
        pool.update(k=kc.view(num_pages, page, D), v=vc.view(num_pages, page, D),
                    k_scale=ks.view(num_pages, page), v_scale=vs.view(num_pages, page))
    table = torch.randperm(num_pages, generator=gen)[: B * H * width].view(B, H, width).to(torch.int32)
    positions = torch.full((num_pages, page), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            s0 = min(sink, n)
            pos = torch.cat([torch.arange(s0), torch.arange(N - (n - s0), N)])
            j = torch.arange(n)
            positions.view(-1)[table[b, h, j // page].long() * page + j % page] = pos
    q_pos = torch.arange(N - T, N)[None].expand(B, T).contiguous()
    q = torch.randn(B, H * G, T, D, generator=gen).to(dtype)
    moved = {name: x.to(DEVICE) for name, x in pool.items()}
    return q.to(DEVICE), moved, table.to(DEVICE), lengths.to(DEVICE), positions.to(DEVICE), q_pos.to(DEVICE)


def run(case, windows, sink, splits=1, heads=None, config=SMALL, ring=True):
    q, pool, table, lengths, positions, q_pos = case
    scales = {name: pool[name] for name in ("k_scale", "v_scale") if name in pool}
    w = torch.tensor(windows, dtype=torch.int32, device=q.device)
    ref = reference.paged_chunk(q.float(), pool["k"], pool["v"], table, lengths, window=w, key_positions=positions,
                                query_positions=q_pos, sink=sink, **scales)
    out = torch.full_like(q, float("nan"))
    chunk_attention(q, pool["k"], pool["v"], table, lengths, splits, window=w, key_positions=positions,
                    query_positions=q_pos, sink=sink, ring=ring, out=out, config=config,
                    heads=None if heads is None else torch.tensor(heads, dtype=torch.int32, device=q.device),
                    **scales)
    return out, ref


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("G", [1, 4])
def test_ring_heads_equal_the_reference(splits, G):
    """A first chunk (nothing kept), a later chunk over a ring, and a head without a window, beside
    each other; windows shorter and longer than a key tile, a sink not a multiple of it."""
    case = ring_case(2, 3, G, 32, 4, [[0, 37, 50], [23, 9, 61]], 45, 300, sink=7, dtype=torch.float32)
    for windows in ([5, 20, NO_WINDOW], [33, NO_WINDOW, 1], [200, 17, 16]):
        out, ref = run(case, windows, sink=7, splits=splits)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-5, windows


def test_a_first_chunk_longer_than_window_and_sink():
    """LServe's first slice of a prompt: every head holds only the chunk (positions 0..T-1)."""
    case = ring_case(1, 2, 2, 16, 4, [0, 0], 90, 90, sink=10, dtype=torch.float32)
    out, ref = run(case, [12, NO_WINDOW], sink=10)
    assert rel(out, ref) < 1e-5
    # A sink longer than the chunk: every entry a sink entry, plain causal.
    out, ref = run(case, [12, 3], sink=200)
    assert rel(out, ref) < 1e-5


def test_a_head_subset_leaves_the_other_rows():
    case = ring_case(1, 4, 2, 16, 4, [30, 12, 0, 44], 21, 100, sink=5, dtype=torch.float32)
    out, ref = run(case, [9, NO_WINDOW, 40, 14], sink=5, heads=[0, 3])
    G = 2
    for h in range(4):
        rows = slice(h * G, (h + 1) * G)
        if h in (0, 3):
            assert rel(out[:, rows], ref[:, rows]) < 1e-5
        else:
            assert out[:, rows].isnan().all()


@pytest.mark.parametrize("kv", list(KV))
def test_quantized_ring_pools(kv):
    case = ring_case(1, 2, 2, 32, 8, [40, 70], 26, 500, sink=8, dtype=torch.float32, kv=kv)
    out, ref = run(case, [24, NO_WINDOW], sink=8, splits=2)
    assert rel(out, ref) < 1e-5


def test_the_position_path_agrees_on_ring_heads():
    """ring=False reads positions tile by tile: the same attention."""
    case = ring_case(1, 2, 2, 16, 4, [25, 3], 30, 80, sink=6, dtype=torch.float32)
    ring, ref = run(case, [10, 19], sink=6, ring=True)
    plain, _ = run(case, [10, 19], sink=6, ring=False)
    assert rel(ring, ref) < 1e-5 and rel(plain, ring) < 1e-5


def test_the_ring_launch_config_of_a_long_chunks_streaming_heads():
    """Half precision, one split, a head subset, no config given: the ring's own launch settings
    (RING_CONFIG's taller row blocks), rows past one block. fp16: the interpreter has no bf16."""
    case = ring_case(1, 2, 4, 32, 16, [0, 0], 130, 130, sink=16, dtype=torch.float16)
    out, ref = run(case, [NO_WINDOW, 48], sink=16, config=None, heads=[1])
    assert rel(out[:, 4:8], ref[:, 4:8]) < 1e-2
    assert out[:, :4].isnan().all()


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kept", [0, 8448])
def test_engine_tiles_ring_bf16(kept):
    """Llama-3.1-8B's heads at the engine's tiles: half the heads stream (sink 128, window 8192)."""
    H, G, T = 8, 4, 4096
    case = ring_case(1, H, G, 128, 16, [[kept] * H], T, kept + T + 20000 * (kept > 0), sink=128,
                     dtype=torch.bfloat16)
    windows = [8192 if h % 2 else NO_WINDOW for h in range(H)]
    out, ref = run(case, windows, sink=128, config=None)
    assert rel(out, ref) < 1e-2
    out, ref = run(case, windows, sink=128, config=None, heads=[1, 3, 5, 7])
    assert rel(out[:, 4:8], ref[:, 4:8]) < 1e-2
