"""A long chunk over a long history as two attention calls merged by their log-sum-exp
(attention/chunk.py split_history): against causal attention over the concatenated keys, through the
engine's Step (which heads take it, quantized pools) and against transformers' logits, in fp32 on its
reference path (a softmax with the log-sum-exp; on a GPU too); on a GPU also the cuDNN path in bf16
(marked gpu)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import chunk, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the cuDNN path in bf16")


def relative_error(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def parts(B, H, G, D, S, T, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, T, D, generator=gen)
    k_hist, v_hist = torch.randn(B, H, S, D, generator=gen), torch.randn(B, H, S, D, generator=gen)
    k_new, v_new = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    return [t.to(device, dtype) for t in (q, k_hist, v_hist, k_new, v_new)]


@pytest.mark.parametrize("B,H,G,S,T,scale", [(1, 2, 4, 37, 11, None), (2, 3, 1, 5, 9, 0.3), (1, 1, 2, 64, 64, None)])
def test_split_equals_causal_attention_over_history_and_chunk(B, H, G, S, T, scale):
    """Every history key visible to every new token, the chunk causal over itself, GQA groups folded;
    on the CPU reference path, fp32."""
    q, k_hist, v_hist, k_new, v_new = parts(B, H, G, 16, S, T, torch.float32, "cpu")
    got = chunk.split_history(q, k_hist, v_hist, k_new, v_new, scale=scale)
    want = reference.causal_suffix(q, torch.cat([k_hist, k_new], 2), torch.cat([v_hist, v_new], 2), scale=scale)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert relative_error(got, want) < 1e-5


def test_merge_kernel_equals_the_reference_merge():
    """The one-pass merge (Triton; interpreted on CPU) against the torch merge, from strided inputs
    into an output laid out [B, T, Hq, D] as the engine's step hands it."""
    from turnkv.attention.triton import lse_merge

    gen = torch.Generator().manual_seed(5)
    B, Hq, T, D = 2, 3, 21, 16
    a = torch.randn(B, T, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)  # strided
    b = torch.randn(B, Hq, T, D, generator=gen).to(DEVICE)
    lse_a, lse_b = (torch.randn(B, Hq, T, generator=gen).to(DEVICE) * 4 for _ in range(2))
    lse_b[0, 0, :3] = float("-inf")  # a row with no key on one side takes the other whole
    out = torch.empty(B, T, Hq, D, device=DEVICE).transpose(1, 2)
    got = lse_merge.merge(a, lse_a, b, lse_b, out)
    assert got.data_ptr() == out.data_ptr()
    want = chunk._merge_reference(a, lse_a, b, lse_b)
    assert relative_error(got, want) < 1e-6
    assert torch.equal(got[0, 0, :3], a[0, 0, :3])


def test_split_is_taken_for_long_chunks_over_long_histories_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    # The engine's 32K slices over what earlier slices kept, and turns large enough to repay cuDNN's plans
    # (benchmarks/prefill/README.md); shorter turns over any history keep the paged kernel.
    assert chunk.uses_split(cuda, bf16, 32768, 32768) and chunk.uses_split(cuda, bf16, 32768, 98304)
    assert chunk.uses_split(cuda, bf16, 4096, 65536) and chunk.uses_split(cuda, bf16, 32768, 8192)
    assert not chunk.uses_split(cuda, bf16, 512, 129536) and not chunk.uses_split(cuda, bf16, 4096, 32768)
    assert not chunk.uses_split(cuda, bf16, 512, 32768) and not chunk.uses_split(cuda, bf16, 512, 8192)
    assert not chunk.uses_split(cuda, bf16, chunk.SPLIT_MIN_ROWS - 1, 10**6)  # short turns keep the paged kernel
    assert not chunk.uses_split(cuda, bf16, 32768, chunk.SPLIT_MIN_HISTORY - 1)
    assert not chunk.uses_split(cuda, torch.float32, 32768, 10**6)  # cuDNN attention takes fp16 / bf16 only
    assert not chunk.uses_split(torch.device("cpu"), bf16, 32768, 10**6)


def test_fresh_chunks_take_cudnn_only_where_its_plan_pays(monkeypatch):
    """cuDNN builds a plan for every new shape: fresh chunks from CUDNN_MIN_ROWS take it directly,
    shorter ones SDPA (under the runner's sdpa_backends: no cuDNN), in bf16 on CUDA (forced here)."""
    monkeypatch.setattr(chunk, "_cudnn", lambda device, dtype: True)
    taken = []
    monkeypatch.setattr(chunk, "_cudnn_attention", lambda q, k, v, causal, scale=None, with_lse=False:
                        taken.append(("cudnn", q.shape[2], causal)) or (q, None))
    monkeypatch.setattr(reference, "causal_prefill", lambda q, k, v: taken.append(("sdpa", q.shape[2])) or q)
    least = chunk.CUDNN_MIN_ROWS
    for T in (2, least - 1, least):
        q = torch.zeros(1, 2, T, 8)
        chunk.fresh_causal(q, q[:, :1], q[:, :1])
    assert taken == [("sdpa", 2), ("sdpa", least - 1), ("cudnn", least, True)]


def test_sdpa_keeps_off_cudnn_under_its_threshold_on_cuda():
    """sdpa_backends: on CUDA, SDPA without cuDNN for steps of fewer than CUDNN_MIN_ROWS new tokens
    (decode included), torch's default order from it; off CUDA nothing changes. The switch is process
    state: reading it needs no GPU."""
    cuda = torch.device("cuda")
    default = torch.backends.cuda.cudnn_sdp_enabled()
    assert default  # torch's default: a test above would otherwise prove nothing
    for n in (1, 512, chunk.CUDNN_MIN_ROWS - 1):
        with chunk.sdpa_backends(cuda, n):
            assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    for device, n in ((cuda, chunk.CUDNN_MIN_ROWS), (cuda, 10**6), (torch.device("cpu"), 1)):
        with chunk.sdpa_backends(device, n):
            assert torch.backends.cuda.cudnn_sdp_enabled()


def test_every_runner_step_runs_under_the_backends_of_its_width(monkeypatch, tmp_path):
    """The runner's prefill chunks and decode steps each enter sdpa_backends with their own number of
    new tokens, around the whole model call (every layer's SDPA, the patterns' dense heads included):
    chunks of 4, 4 and 2 tokens, then one decode step."""
    from tests.conftest import save_tiny
    from tests.model.test_oracle import runner_for
    from turnkv.kv.sequence import SequenceKV
    from turnkv.model.load import load_model

    save_tiny(tmp_path, "llama")
    runner, pool = runner_for(load_model(str(tmp_path), dtype="float32").model)
    runner.prefill_chunk = 4
    entered = []

    @contextlib.contextmanager
    def backends(device, num_new):
        entered.append((device.type, num_new))
        yield

    monkeypatch.setattr(chunk, "sdpa_backends", backends)
    seq = SequenceKV(pool)
    runner.prefill(seq, list(range(3, 13)))
    runner.decode([seq], torch.tensor([5]))
    assert entered == [("cpu", 4), ("cpu", 4), ("cpu", 2), ("cpu", 1)]


@CUDA
def test_cudnn_called_directly_runs_with_cudnn_sdpa_switched_off():
    """fresh_causal's and split_history's cuDNN calls go to the op itself, so a step under
    sdpa_backends (cuDNN's SDPA off) still runs them: the same output as outside it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, 700, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (8, 2, 2))
    outside = chunk._cudnn_attention(q, k, v, True)[0]
    with chunk.sdpa_backends(torch.device("cuda"), 700):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        inside = chunk._cudnn_attention(q, k, v, True)[0]
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                           enable_gqa=True)
    assert relative_error(inside, ref) < 2e-2


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_step_splits_only_where_every_head_holds_the_same_history(monkeypatch, kv_dtype):
    """Step's split path (forced on CPU) equals the reference path for even heads, a quantized pool's
    round trip included; a layer with uneven heads keeps the paged path."""
    from turnkv.engine.step import Step
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    L, H, G, D, page = 2, 2, 2, 16, 4
    pool = PagePool(L, H, D, 64, page_size=page, dtype=torch.float32, device=DEVICE, kv_dtype=kv_dtype)
    seq = SequenceKV(pool)
    gen = torch.Generator().manual_seed(1)
    calls = []
    split = chunk.split_history
    monkeypatch.setattr(chunk, "split_history", lambda *a, **kw: calls.append(a[0].shape) or split(*a, **kw))

    def step(T, forced):
        monkeypatch.setattr(chunk, "ENABLED", forced)
        monkeypatch.setattr(chunk, "FORCE", forced)
        monkeypatch.setattr(chunk, "uses_split", lambda device, dtype, num_new, history: forced)
        slots = seq.reserve(T)
        positions = torch.arange(seq.next_position - T, seq.next_position, device=DEVICE)[None]
        return Step(pool, [seq], [slots], positions)

    def attend(s, q, k, v):
        return [s.attention(layer, q[layer], k[layer], v[layer]) for layer in range(L)]

    T0 = 13
    q0, k0, v0 = (torch.randn(L, 1, T0, n, D, generator=gen).to(DEVICE) for n in (H * G, H, H))
    attend(step(T0, False), q0, k0, v0)
    seq.keep(1, [torch.arange(T0), torch.arange(3, T0)])  # layer 1: uneven heads
    T = 6
    q, k, v = (torch.randn(L, 1, T, n, D, generator=gen).to(DEVICE) for n in (H * G, H, H))
    got = attend(step(T, True), q, k, v)
    assert calls == [(1, H * G, T, D)]  # layer 0 only
    seq.truncate(seq.next_position - T)
    want = attend(step(T, False), q, k, v)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 1e-5


def test_later_chunks_through_the_split_match_transformers(tmp_path, monkeypatch):
    """A tiny model prefilled in chunks of 8 over two turns, every later chunk through the split,
    gives transformers' logits of the whole sequence at once."""
    from tests.conftest import two_turn_logits

    calls = []
    split = chunk.split_history
    monkeypatch.setattr(chunk, "split_history", lambda *a, **kw: calls.append(a[0].shape) or split(*a, **kw))
    monkeypatch.setattr(chunk, "ENABLED", True)
    monkeypatch.setattr(chunk, "FORCE", True)
    monkeypatch.setattr(chunk, "uses_split", lambda device, dtype, num_new, history: True)
    ours, ref, c = two_turn_logits(tmp_path, "llama", DEVICE)
    assert len(calls) == 4 * c.num_layers  # every chunk after the first
    assert relative_error(ours, ref) < 1e-4


# ---- the GPU lane: cuDNN, bf16 ------------------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("S,T", [(16384, 2048), (4000, 3000)])
def test_cudnn_split_matches_the_paged_kernel_bf16(S, T):
    """Llama-3.1-8B's heads (32 / 8, D 128) in bf16: the cuDNN split against the fp32 reference over
    the concatenated keys, at the rounding of bf16."""
    q, k_hist, v_hist, k_new, v_new = parts(1, 8, 4, 128, S, T, torch.bfloat16, "cuda", seed=3)
    got = chunk.split_history(q, k_hist, v_hist, k_new, v_new)
    keys, values = torch.cat([k_hist, k_new], 2).float(), torch.cat([v_hist, v_new], 2).float()
    want = reference.causal_suffix(q.float(), keys, values)
    assert got.dtype == torch.bfloat16 and relative_error(got, want) < 2e-2


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("T", [1, 700, 4096, 12288])
def test_fresh_causal_through_cudnn_matches_sdpa_bf16(T):
    """A fresh chunk's causal attention, short ones through torch's flash attention and long ones with
    the query groups handed to cuDNN as they are, against the fp32 reference (reference.causal_prefill),
    bf16, Llama-3.1-8B's heads."""
    q, k, v = parts(1, 8, 4, 128, T, T, torch.bfloat16, "cuda", seed=4)[:3]
    got = chunk.fresh_causal(q, k, v)
    # The fp32 reference for the first KV head's query group only: SDPA's fp32 GQA path materializes
    # the scores (12288 rows: 2.4 GB for these four heads, 19 GB for all 32).
    want = reference.causal_prefill(q[:, :4].float(), k[:, :1].float(), v[:, :1].float())
    assert got.shape == q.shape and relative_error(got[:, :4], want) < 2e-2
