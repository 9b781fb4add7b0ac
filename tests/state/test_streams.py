"""The load stream's copies read device tensors made on the current stream (the slots rows go to);
those must not be handed out again by the caching allocator before the copies have read them, even
when the caller drops the LoadStream at once (otherwise the next prefill's tensors may overwrite the
slots first, and the copies index out of bounds)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import turnkv
from conftest import save_tiny
from turnkv.kv.sequence import SequenceKV
from turnkv.state import streams
from turnkv.state.load import LoadStrategy


class _FakeStream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass


def test_run_protects_device_sources_from_reuse_and_keeps_host_sources(monkeypatch):
    """Without a GPU: CUDA's stream API faked, a meta tensor standing in for device memory. Every
    device source of a layer's work is record_stream'ed on the load stream (so its block outlives the
    LoadStream object); host sources are held until synchronize()."""
    recorded = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)))
    load = streams.LoadStream(torch.device("cuda"))
    assert load.cuda
    slots = torch.empty(16, dtype=torch.int64, device="meta")
    mask = torch.empty(16, dtype=torch.bool, device="meta")
    host = torch.zeros(16, 4)
    ran = []
    load.run(3, lambda: ran.append(3), host, slots, mask)
    assert ran == [3] and 3 in load.events
    assert [t for t, _ in recorded] == [slots, mask] and all(s is load.stream for _, s in recorded)
    assert len(load.keep_alive) == 1 and load.keep_alive[0] is host
    load.synchronize()
    assert load.keep_alive == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the race is between two streams")
def test_dropped_load_stream_restores_exactly_while_its_memory_is_reused(tmp_path, monkeypatch):
    """On a GPU: the load stream is held back (a sleep before its copies), the returned LoadStream is
    dropped, and the current stream at once allocates and fills tensors the size of the freed slots.
    Without record_stream the copies would read the overwritten slots (a device-side assert in
    index_copy_)."""
    save_tiny(tmp_path, "llama")  # no tokenizer needed: nothing is tokenized
    llm = turnkv.LLM(str(tmp_path), device="cuda", kv_memory="1GiB", state_cpu_memory="512MiB")
    pool, ctx, tiers = llm.pool, llm.state.ctx, llm.state.tiers
    n = 1 << 18
    seq = SequenceKV(pool)
    seq.reserve(n)
    pool.k.normal_()
    pool.v.normal_()
    stored = LoadStrategy().pack(ctx, seq, None, "cpu")
    tiers.put("t", {"state": stored.meta}, stored.tensors, "cpu")
    _, meta, host = tiers.get("t")
    reference = [seq.gather(layer)[0].clone() for layer in range(pool.num_layers)]
    start = streams.LoadStream.start

    def slow_start(self):
        start(self)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the current stream runs far ahead

    monkeypatch.setattr(streams.LoadStream, "start", slow_start)
    restored = SequenceKV(pool)
    torch.cuda.synchronize()
    LoadStrategy().restore(ctx, restored, list(range(n)), meta["state"], host)  # the stream is dropped here
    # Take every cached block the slots' size would fit in (the freed slots among them) and fill it
    # with an out-of-range index, while the load stream still sleeps.
    size = pool.num_layers * pool.num_kv_heads * n
    junk = []
    while torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 8 * size and len(junk) < 256:
        reserved = torch.cuda.memory_reserved()
        junk.append(torch.full((size,), 1 << 40, dtype=torch.int64, device="cuda"))
        if torch.cuda.memory_reserved() > reserved:
            break  # a fresh segment: the cache held no more such blocks
    torch.cuda.synchronize()
    del junk
    for layer in llm.model.layers:  # the gates of a forward that never came
        layer._forward_pre_hooks.clear()
    for layer, ref in enumerate(reference):
        assert torch.equal(restored.gather(layer)[0], ref)
    restored.free()
    seq.free()
    tiers.delete("t")
