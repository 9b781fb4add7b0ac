"""Where a streaming-heads prefill chunk runs: the engine's causal path when every row sees all its
heads keep, the paged chunk kernel with a window per KV head and the sink for short chunks that
reach past a window, the pattern's `attend` otherwise; same replies and cells either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.methods.test_lserve_streaming import LONG_TURNS, STREAMING
from turnkv.attention.lines import Keys
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.pattern import HeadPattern
from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill


@pytest.fixture
def pattern_file(tmp_path):
    path = tmp_path / "pattern.json"
    HeadPattern(np.array(STREAMING)).save_json(path)
    return str(path)


@pytest.mark.parametrize("kernel, kv_dtype", [(False, None), (True, None), (False, "int8")])
def test_chunks_take_the_engine_causal_path(chat_llm, chat_model_dir, pattern_file, monkeypatch, kernel, kv_dtype):
    """A chunk whose streaming heads hold sink + one run within prefill_local (a later turn over the
    trimmed ring) is plain causal attention over the kept keys: the engine runs it without calling
    attend, with the replies and the per-turn density the pattern path gives. A chunk that reaches
    past the window (the long first turn) runs its whole heads on the dense paths and its streaming
    heads on the windowed block decomposition (attention/streaming.py), or with the paged chunk
    kernel (CUDA; here Triton's interpreter) through the kernel with a window per head and the sink.
    The same on an int8 pool, where both paths read the same codes."""
    import importlib.util

    from turnkv.attention import chunk, streaming

    if kernel and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import turnkv

    llm = chat_llm
    if kernel and torch.cuda.is_available():  # the compiled kernel reads CUDA tensors only
        llm = turnkv.LLM(str(chat_model_dir), device="cuda", dtype=torch.float32, kv_memory="64MiB")
    if kv_dtype is not None:  # the split heads read the pool's codes and scales, as attend's gather does
        llm = turnkv.LLM(str(chat_model_dir), device="cuda" if torch.cuda.is_available() else "cpu",
                         dtype=torch.float32, kv_memory="64MiB", kv_dtype=kv_dtype)
    sink, local, prefill_local = 4, 8, 48
    recipe = f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local},prefill_local={prefill_local})"
    windowed_calls, ring_calls = [], []
    real_windowed, real_paged = streaming.windowed_chunk, chunk.paged_chunk

    def windowed(q, *args, **kw):
        windowed_calls.append(q.shape[2])
        return real_windowed(q, *args, **kw)

    def paged(q, *args, **kw):
        if kw.get("ring"):
            ring_calls.append((q.shape[2], kw.get("heads") is not None))
        return real_paged(q, *args, **kw)

    real_attend = StreamingHeadsPrefill.attend

    def run(plain: bool):
        calls = []
        monkeypatch.setattr(chunk, "FORCE", kernel)
        monkeypatch.setattr(streaming, "windowed_chunk", windowed)
        monkeypatch.setattr(chunk, "paged_chunk", paged)

        def attend(self, layer, keys, **kw):
            calls.append((layer, keys.q_pos[0, 0].item(), keys.q.shape[2]))
            return real_attend(self, layer, keys, **kw)

        monkeypatch.setattr(StreamingHeadsPrefill, "attend", attend)
        if not plain:
            monkeypatch.setattr(StreamingHeadsPrefill, "chunk_windows", lambda self, seqs, n: None)
        conv = llm.conversation(system="Answer briefly.", recipe=recipe)
        try:
            out = []
            for message in LONG_TURNS:
                reply = conv.send(message, max_new_tokens=12, ignore_eos=True, logprobs=True)
                out.append((conv.turns[-1].start, conv.turns[-1].prompt_end, reply.token_ids, reply.logprobs))
            stats = [entry["prefill"]["density"] for entry in conv.method_stats if "prefill" in entry]
        finally:
            conv.close()
        monkeypatch.undo()
        return out, stats, calls

    plain, plain_density, plain_calls = run(True)
    pattern, pattern_density, pattern_calls = run(False)
    for (start, end, ids, logprobs), (_, _, ids_p, logprobs_p) in zip(plain, pattern):
        assert ids == ids_p
        torch.testing.assert_close(logprobs, logprobs_p, rtol=0, atol=1e-4)
    assert plain_density == pytest.approx(pattern_density, rel=1e-12) and len(plain_density) == 3
    assert plain_density[0] < 1  # the first turn reaches past its streaming heads' window
    # The first turn's prompt is longer than the window: it goes through attend. The last turn's
    # short prompt over the trimmed ring does not.
    first_end, (last_start, last_end) = plain[0][1], plain[2][:2]
    assert first_end - sink > prefill_local and last_end - last_start < prefill_local - local - llm.pool.page_size
    # No chunk of the engine's run called attend: with the kernel every chunk after the system prompt
    # took it, windowed or not; without, the first turn's (longer than the window) split its heads.
    assert plain_calls == [] and (kernel or windowed_calls)
    assert any(position >= last_start for _, position, _ in pattern_calls)
    # With the kernel the windowed chunks take its ring iterator, all heads in one launch.
    assert bool(ring_calls) == kernel and not any(subset for _, subset in ring_calls)
    if kernel:  # a chunk longer than WINDOWED_CHUNK_ROWS that needs windows splits its heads too
        from turnkv.engine import step as step_module

        monkeypatch.setattr(step_module, "WINDOWED_CHUNK_ROWS", 64)
        windowed_calls.clear(), ring_calls.clear()
        limited, _, limited_calls = run(True)
        assert [r[2] for r in limited] == [r[2] for r in plain]
        # The streaming heads alone on the ring iterator; nothing on the block decomposition.
        assert limited_calls == [] and windowed_calls == [] and max(T for T, subset in ring_calls if subset) > 64


def attend_counts(method, seq, T: int):
    """attend's computed and causal cells per layer [L, H] for the last T rows of `seq` (random
    queries and keys over the positions the store holds), the reference for chunk_windows' counts."""
    L, H = seq.lengths.shape
    N, S = seq.next_position, int(seq.lengths.max())
    computed, causal = np.zeros((L, H)), np.zeros((L, H))
    for layer in range(L):
        _, _, pos = seq.gather(layer)
        valid = torch.arange(S)[None] < torch.from_numpy(seq.lengths[layer])[:, None]
        keys = Keys(torch.randn(1, 2 * H, T, 8), torch.randn(1, H, S, 8), torch.randn(1, H, S, 8),
                    torch.arange(N - T, N)[None], pos[None, :, :S], valid[None], N - T, N)
        _, stats = method.attend(layer, keys)
        computed[layer], causal[layer] = stats["computed"].reshape(-1), stats["causal"].reshape(-1)
    return computed, causal


def test_chunk_windows_by_position_and_their_cells(pattern_file):
    """chunk_windows: no window while every streaming head's run fits prefill_local, the window past
    it, None where a streaming head is not sink + one run (attend counts those); the cells it counts
    equal attend's in every case."""
    from turnkv.kv.pool import PagePool
    from turnkv.methods.lserve.streaming_heads import NO_WINDOW

    method = StreamingHeadsPrefill(pattern=pattern_file, sink=4, local=8, prefill_local=20)
    method.bind(2)
    seq = SequenceKV(PagePool(2, 2, 8, 64, page_size=4))

    def check(T, windowed):
        windows = method.chunk_windows([seq], T)
        assert (windows.windows is not None) == windowed
        if windowed:
            assert windows.windows.tolist() == [[20, NO_WINDOW], [NO_WINDOW, 20]] and windows.sink == 4
        computed, causal = attend_counts(method, seq, T)
        assert windows.computed[:, 0].tolist() == computed.tolist()
        assert windows.causal[:, 0].tolist() == causal.tolist()

    seq.reserve(24)  # fresh: 24 - sink = 20 tokens after the sink, all within the window
    check(24, False)
    seq.reserve(9)  # a chunk whose last rows reach past the window
    check(9, True)
    method.trim(seq)  # streaming heads back to sink + ring
    seq.reserve(3)
    check(3, False)
    seq.reserve(30)  # a later turn's long chunk over the ring
    check(30, True)
    seq.moves[0, 0] += 1  # layer 0 head 0 streams: something moved it since the trim
    assert method.chunk_windows([seq], 1) is None
    seq.moves[0, 1] += 1  # a dense head moving does not matter
    seq.moves[0, 0] -= 1
    check(1, True)
    assert StreamingHeadsPrefill(pattern=pattern_file, dense="a_shape").chunk_windows([seq], 1) is None
    seq.truncate(seq.next_position - 2)  # a rollback cuts the newest tokens: still sink + one run
    seq.reserve(2)
    check(2, True)
    n = int(seq.lengths[1, 1])  # layer 1 head 1 streams: a hole in its run is a reorder
    seq.keep(1, [list(range(int(seq.lengths[1, 0]))), [i for i in range(n) if i != n - 3]])
    assert method.chunk_windows([seq], 1) is None
    seq.free()
