"""Admission by memory (serve/admission.py): the pages a request will add at its largest, under its
recipe, against the pool's free pages and idle conversations, beside running requests' headroom."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe
from turnkv.serve.admission import MemoryGate, resident_tokens

PAGE = 16


def recipe(text: str | None) -> Recipe:
    return Recipe.parse(text) if text else Recipe()


def test_resident_tokens_follow_the_recipe():
    assert resident_tokens(recipe(None), 32768, 32768) == 32768
    assert resident_tokens(recipe("ada-snapkv keep_ratio=0.1"), 32768, 32768) == 3277
    assert resident_tokens(recipe("snapkv budget=128"), 32768, 32768) == 128
    assert resident_tokens(recipe("snapkv budget=128"), 100, 100) == 100  # never more than it holds
    assert resident_tokens(recipe("flowkv budget=128"), 5000, 1000) == 1128  # the running turn stays whole
    assert resident_tokens(recipe("snapkv budget=128 schedule=turn_end"), 5000, 1000) == 5000
    assert resident_tokens(recipe("ada-snapkv keep_ratio=0.1 schedule=prompt"), 32768, 32768) == 3277


class FakeStore:
    def __init__(self, idle_bytes: int = 0):
        self.idle_bytes = idle_bytes

    def kv_bytes(self, tier: str) -> int:
        assert tier == "gpu"
        return self.idle_bytes


def job(pool, recipe_text, held: int, prompt: int, max_new: int, generated: int = 0):
    """A request whose conversation holds `held` tokens per head, with `prompt` tokens left to prefill."""
    seq = SequenceKV(pool)
    if held:
        seq.reserve(held)
    gen = SimpleNamespace(params=SimpleNamespace(max_new_tokens=max_new), token_ids=[0] * generated)
    turn = SimpleNamespace(recipe=recipe(recipe_text), prefill_left=prompt, seq=seq, gen=gen)
    return SimpleNamespace(conv=SimpleNamespace(kv=seq), turn=turn)


@pytest.fixture
def pool():
    return PagePool(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=400, page_size=PAGE)


def test_headroom_by_numbers(pool):
    gate = MemoryGate(pool, FakeStore())
    pages = lambda tokens: 2 * -(-tokens // PAGE)  # noqa: E731 (2 KV heads)
    decoding = job(pool, None, held=1000, prompt=0, max_new=100, generated=40)
    assert gate.held(decoding) == pages(1000) == 126
    assert gate.headroom(decoding) == pages(1000 + 60) - 126  # what its reply still adds
    dense = job(pool, None, held=0, prompt=1000, max_new=100)
    assert gate.headroom(dense) == pages(1100) == 138
    # Compressed: the whole prompt is in the pool until its end compresses it.
    small = job(pool, "ada-snapkv keep_ratio=0.1", held=0, prompt=1000, max_new=100)
    assert gate.headroom(small) == pages(1000)
    # A compressed conversation's next turn: it holds its compressed history, adds its new prompt.
    later = job(pool, "ada-snapkv keep_ratio=0.1", held=208, prompt=20, max_new=100)
    assert gate.headroom(later) == pages(max(228, 123 + 100)) - pages(208)


def test_a_request_waits_while_running_ones_need_the_room(pool):
    gate = MemoryGate(pool, FakeStore())
    running = [job(pool, None, held=1000, prompt=0, max_new=100), job(pool, None, held=1000, prompt=0, max_new=100)]
    free = 400 - 2 * 126
    assert gate.available() == free == 148
    dense = job(pool, None, held=0, prompt=1000, max_new=100)
    assert 138 + 2 * 12 > free and not gate.fits(dense, running)
    short = job(pool, None, held=0, prompt=400, max_new=100)
    assert 2 * 32 + 2 * 12 <= free and gate.fits(short, running)
    assert gate.fits(dense, [])
    big = job(pool, None, held=0, prompt=1400, max_new=100)
    assert gate.headroom(big) > free and not gate.fits(big, [])  # alone it may start anyway (the scheduler's)


def test_idle_conversations_count_as_room(pool):
    running = [job(pool, None, held=1000, prompt=0, max_new=100), job(pool, None, held=1000, prompt=0, max_new=100)]
    dense = job(pool, None, held=0, prompt=1000, max_new=100)
    idle_pages = 20  # per layer: they move to the tiers when the pool needs their room
    gate = MemoryGate(pool, FakeStore(idle_bytes=idle_pages * pool.page_bytes * pool.num_layers))
    assert gate.available() == 148 + idle_pages
    assert gate.fits(dense, running)


def test_compressed_conversations_leave_room_for_more(pool):
    """After its prompt, a conversation at keep_ratio=0.1 holds a tenth: the pool that runs 2 dense
    ones of 1000 tokens and a third only after they finish runs many compressed ones together."""
    gate = MemoryGate(pool, FakeStore())
    dense, compressed = [], []
    while gate.fits(job(pool, None, held=0, prompt=1000, max_new=100), dense):
        dense.append(job(pool, None, held=1000, prompt=0, max_new=100))
    for j in dense:
        j.conv.kv.free()
    while gate.fits(job(pool, "ada-snapkv keep_ratio=0.1", held=0, prompt=1000, max_new=100), compressed):
        compressed.append(job(pool, "ada-snapkv keep_ratio=0.1", held=100, prompt=0, max_new=100))
    assert len(dense) == 2
    assert len(compressed) >= 5 * len(dense)


def test_streaming_heads_count_what_their_trim_leaves(pool, tmp_path):
    """LServe's streaming heads keep their sink and a ring (during the prompt, the prefill window and
    the slice in flight): a request counts that much for them, every token for the dense heads, in
    the layer with the most dense heads; and so more LServe conversations fit than full-cache ones."""
    import numpy as np

    from turnkv.methods.lserve.pattern import HeadPattern

    HeadPattern(np.array([[True, False], [False, True]])).save_json(tmp_path / "pattern.json")
    text = f"prefill=streaming_heads(pattern={tmp_path / 'pattern.json'},sink=16,local=32,prefill_local=64)"
    whole = 1  # one dense head in every layer
    gate = MemoryGate(pool, FakeStore(), slice_tokens=32)
    pages = lambda tokens: -(-tokens // PAGE)  # noqa: E731 (one head)
    streaming = pool.num_kv_heads - whole
    during = whole * pages(1000) + streaming * pages(16 + 64 + PAGE - 1 + 32)
    after = whole * pages(1100) + streaming * pages(16 + 32 + PAGE - 1)
    assert gate.headroom(job(pool, text, held=0, prompt=1000, max_new=100)) == max(during, after)
    assert gate.headroom(job(pool, None, held=0, prompt=1000, max_new=100)) == pool.num_kv_heads * pages(1100)
    # A short conversation keeps everything either way.
    assert gate.headroom(job(pool, text, held=0, prompt=20, max_new=10)) == pool.num_kv_heads * pages(30)
    dense, streamed = [], []
    while gate.fits(job(pool, None, held=0, prompt=1000, max_new=100), dense):
        dense.append(job(pool, None, held=1000, prompt=0, max_new=100))
    for j in dense:
        j.conv.kv.free()
    while gate.fits(job(pool, text, held=0, prompt=1000, max_new=100), streamed):
        streamed.append(job(pool, text, held=600, prompt=0, max_new=100))
    assert len(streamed) > len(dense)
