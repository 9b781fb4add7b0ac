"""The vertical + slash line kernel against the reference mask path (blockwise_attention over
line_mask): GQA groups, lines per query head and per KV head, history + new rows, overlapping lines,
contiguous slash ranges (dense causal, local windows), empty sets, sliding windows, ragged batches, and
the dispatch that sends other layouts to the reference. On CPU it runs in Triton's interpreter at
small shapes, with 16-row tiles so that every case spans several query and key blocks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import lines  # noqa: E402
from turnkv.attention.triton import lines as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter computes in numpy, which has no bfloat16.
DTYPES = [(torch.float32, 1e-3), (torch.float16, 1e-2)] + ([(torch.bfloat16, 1e-2)] if DEVICE == "cuda" else [])
SMALL = dict(block_m=16, block_n=16, num_warps=2, num_stages=1)


def make_keys(B=1, H=2, G=2, D=32, T=37, history=21, dtype=torch.float32, window=None, seed=0):
    """T new rows at positions history..history+T-1 over S = history + T keys at their entry positions."""
    gen = torch.Generator().manual_seed(seed)
    S = history + T
    q = torch.randn(B, H * G, T, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(B, H, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, H, S, D, generator=gen).to(DEVICE, dtype)
    q_pos = (history + torch.arange(T, device=DEVICE)).expand(B, T)
    k_pos = torch.arange(S, device=DEVICE).expand(B, H, S)
    return lines.Keys(q, k, v, q_pos, k_pos, None, history, S, window=window)


def random_lines(keys, per_q, p_vertical=0.15, p_slash=0.2, seed=1):
    """Scattered verticals and slashes, plus sinks and the nearest diagonals (overlapping them)."""
    gen = torch.Generator().manual_seed(seed)
    B, Hq = keys.q.shape[:2]
    N = B * (Hq if per_q else keys.k.shape[1])
    S, O = keys.k.shape[2], keys.end_position
    vertical = torch.rand(N, S, generator=gen) < p_vertical
    vertical[:, :2] = True
    slash = torch.rand(N, O, generator=gen) < p_slash
    slash[:, :3] = True
    return vertical.to(DEVICE), slash.to(DEVICE)


def reference(keys, vertical, slash, per_q):
    """blockwise_attention over line_mask, in fp32 whatever the inputs."""
    keys32 = lines.Keys(keys.q.float(), keys.k.float(), keys.v.float(), keys.q_pos, keys.k_pos, keys.valid,
                        keys.first_position, keys.end_position, keys.window)
    return lines.blockwise_attention(keys32, lambda r: lines.line_mask(keys32, vertical, slash, per_q, r))


def run_kernel(keys, vertical, slash, per_q, config=SMALL):
    """The kernel into a NaN-filled output (every element must be written), and the counts."""
    layout = lines.kernel_layout(keys)
    assert layout is not None
    q_start, kv_len = layout
    block_m = kernel.block_m_for(keys.q.dtype, config)
    plan = kernel.Plan(vertical, slash, q_start, kv_len, keys.q.shape[2], keys.group, per_q, keys.window, block_m)
    out = torch.full_like(keys.q, float("nan"))
    kernel.line_attention(keys.q, keys.k, keys.v, plan, out=out, config=config)
    assert not out.isnan().any(), "every output element must be written"
    return out, *lines.contiguous_counts(keys, vertical, slash, per_q, q_start, kv_len)


def check(keys, vertical, slash, per_q, tol=1e-3):
    out, computed, causal = run_kernel(keys, vertical, slash, per_q)
    ref, ref_computed, ref_causal = reference(keys, vertical, slash, per_q)
    if keys.q.dtype == torch.float32:
        assert (out - ref).abs().max().item() < tol
    else:
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol
    assert torch.equal(computed, ref_computed) and torch.equal(causal, ref_causal)
    return out, ref


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("per_q", [True, False])
def test_random_lines_with_history(dtype, tol, G, per_q):
    keys = make_keys(H=2, G=G, T=37, history=5 + 8 * G, dtype=dtype, seed=G)
    check(keys, *random_lines(keys, per_q, seed=G), per_q, tol)


def test_prefill_without_history_and_one_block():
    keys = make_keys(H=1, G=2, T=13, history=0)
    check(keys, *random_lines(keys, True), True)


def test_all_offsets_is_dense_causal():
    """Every offset selected: one run, one sweep of full blocks; equals SDPA's bottom-right causal."""
    keys = make_keys(G=2, T=45, history=19)
    N, S = 4, keys.k.shape[2]
    none = torch.zeros(N, S, dtype=torch.bool, device=DEVICE)
    every = torch.ones(N, keys.end_position, dtype=torch.bool, device=DEVICE)
    out, ref = check(keys, none, every, True)
    T = keys.q.shape[2]
    causal = torch.ones(T, S, dtype=torch.bool, device=DEVICE).tril(S - T)
    k = keys.k.repeat_interleave(2, dim=1)
    v = keys.v.repeat_interleave(2, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(keys.q, k, v, attn_mask=causal)
    assert (out - dense).abs().max().item() < 1e-3


@pytest.mark.parametrize("per_q", [True, False])
def test_sink_columns_and_local_window_of_slashes(per_q):
    """A-shape: sink verticals + a contiguous window of offsets (straddling key blocks), plus one far
    slash run and a vertical inside the window (counted once)."""
    keys = make_keys(G=2, T=40, history=30)
    N = keys.q.shape[1] if per_q else keys.k.shape[1]
    S, O = keys.k.shape[2], keys.end_position
    vertical = torch.zeros(N, S, dtype=torch.bool, device=DEVICE)
    vertical[:, :4] = True
    vertical[:, 60] = True
    slash = torch.zeros(N, O, dtype=torch.bool, device=DEVICE)
    slash[:, :11] = True
    slash[:, 33:50] = True
    check(keys, vertical, slash, per_q)


def test_empty_verticals_and_empty_slashes():
    keys = make_keys(G=2, T=35, history=12)
    vertical, slash = random_lines(keys, True)
    check(keys, torch.zeros_like(vertical), slash, True)
    check(keys, vertical, torch.zeros_like(slash), True)  # rows before the first column see nothing: 0
    out, computed, _ = run_kernel(keys, torch.zeros_like(vertical), torch.zeros_like(slash), True)
    assert not out.any() and not computed.any()


def test_model_sliding_window():
    keys = make_keys(G=2, T=40, history=24, window=11)
    vertical, slash = random_lines(keys, False, p_slash=0.4)
    slash[:, :9] = True
    check(keys, vertical, slash, False)


def test_ragged_batch_with_head_lengths():
    """Two sequences at different positions; the shorter one's keys end early (valid is a prefix)."""
    B, H, G, D, T = 2, 2, 2, 32, 21
    base = make_keys(B=B, H=H, G=G, D=D, T=T, history=30)
    S = base.k.shape[2]
    q_pos = torch.stack([30 + torch.arange(T), 12 + torch.arange(T)]).to(DEVICE)
    valid = torch.ones(B, H, S, dtype=torch.bool, device=DEVICE)
    valid[1, :, 12 + T:] = False
    k_pos = torch.where(valid, torch.arange(S, device=DEVICE), 0)
    keys = lines.Keys(base.q, base.k, base.v, q_pos, k_pos, valid, 12, S)
    assert lines.kernel_layout(keys) is not None
    check(keys, *random_lines(keys, False), False)


def test_dispatch(monkeypatch):
    keys = make_keys(G=2, T=20, history=10)
    vertical, slash = random_lines(keys, True)
    ref = reference(keys, vertical, slash, True)
    # Off CUDA, without force_triton: the reference path itself, bit for bit.
    if DEVICE == "cpu":
        plain = lines.line_attention(keys, vertical, slash, True)
        assert all(torch.equal(a, b) for a, b in zip(plain, ref))
    forced = lines.line_attention(keys, vertical, slash, True, force_triton=True, config=SMALL)
    assert (forced[0] - ref[0]).abs().max() < 1e-3 and torch.equal(forced[1], ref[1])

    # Holes in the key positions (evicted history): the kernel is not used, the reference is.
    S = keys.k.shape[2]
    kept = torch.cat([torch.arange(0, 4), torch.arange(7, S)]).to(DEVICE)
    holes = lines.Keys(keys.q, keys.k[:, :, kept], keys.v[:, :, kept], keys.q_pos, keys.k_pos[:, :, kept], None,
                       keys.first_position, keys.end_position)
    assert lines.kernel_layout(holes) is None
    monkeypatch.setattr(kernel, "line_attention", lambda *a, **k: pytest.fail("kernel used on holes"))
    got = lines.line_attention(holes, vertical[:, kept], slash, True, force_triton=True)
    expected = lines.blockwise_attention(holes, lambda r: lines.line_mask(holes, vertical[:, kept], slash, True, r))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_patterns_take_the_kernel_where_it_runs(monkeypatch):
    """A-shape, Tri-shape, streaming heads and MInference with the kernel path switched on equal their
    reference path (the CPU behaviour)."""
    from turnkv.methods.prefill.a_shape import AShapePrefill
    from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill
    from turnkv.methods.prefill.minference import MInferencePrefill
    from turnkv.methods.prefill.tri_shape import TriShapePrefill

    keys = make_keys(H=2, G=2, T=40, history=24)
    streaming = StreamingHeadsPrefill(pattern="random", ratio=0.5, sink=3, local=5, prefill_local=7)
    streaming.bind(2)
    streaming._flags[(2, 2)] = torch.tensor([[True, False], [False, True]]).numpy()
    methods = [AShapePrefill(sink=3, local=9), TriShapePrefill(sink=3, local=9, last=10),
               TriShapePrefill(sink=2, local=5, last=100), streaming,
               MInferencePrefill(vertical=5, slash=9, last=8, force_sink=2, force_local=3)]
    monkeypatch.setattr(lines, "uses_kernel", lambda device, force_triton=False: False)
    expected = [m.attend(0, keys) for m in methods]
    monkeypatch.setattr(lines, "uses_kernel", lambda device, force_triton=False: True)
    for method, (ref, ref_stats) in zip(methods, expected):
        out, stats = method.attend(0, keys)
        assert (out - ref).abs().max().item() < 1e-3, method
        assert torch.equal(stats["computed"], ref_stats["computed"]), method
        assert torch.equal(stats["causal"], ref_stats["causal"]), method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_q", [True, False])
def test_cuda_bf16_default_tiles(per_q):
    """The launch configuration the engine uses, at a size with many blocks of each kind."""
    keys = make_keys(H=2, G=4, D=128, T=700, history=1500, dtype=torch.bfloat16, seed=5)
    vertical, slash = random_lines(keys, per_q, p_vertical=0.02, p_slash=0.02)
    slash[:, :300] = True
    out, computed, causal = lines.line_attention(keys, vertical, slash, per_q)
    ref, ref_computed, ref_causal = reference(keys, vertical, slash, per_q)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(computed, ref_computed) and torch.equal(causal, ref_causal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel, not the interpreter")
@pytest.mark.parametrize("runs", [1, 2, 3, 5, 8, 13, 22])
def test_cuda_slash_runs_per_head(runs):
    """1 to 22 runs of slashes per head, far enough apart (more than a query block) to stay separate
    segments, each unit with its own count: the compiled kernel at the engine's tiles against the
    reference."""
    keys = make_keys(H=2, G=4, D=128, T=512, history=4096, dtype=torch.bfloat16, seed=runs)
    units, offsets = keys.q.shape[1], keys.end_position
    vertical = torch.zeros(units, keys.k.shape[2], dtype=torch.bool, device=DEVICE)
    vertical[:, :4] = True
    slash = torch.zeros(units, offsets, dtype=torch.bool, device=DEVICE)
    gap = offsets // 23
    for unit in range(units):
        count = max(1, runs - unit % 3)  # uneven counts across heads, `runs` in the first
        for r in range(count):
            start = r * gap + unit % 5
            slash[unit, start:start + 1 + (r + unit) % 7] = True
    out, computed, causal = lines.line_attention(keys, vertical, slash, True)
    ref, ref_computed, ref_causal = reference(keys, vertical, slash, True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(computed, ref_computed) and torch.equal(causal, ref_causal)
