"""Decode replayed from CUDA graphs gives what the eager step gives: same greedy tokens, logits within
rounding (the graph cuts key lists into a different number of chunks). Needs CUDA."""

from __future__ import annotations

import pytest
import torch

import turnkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def engines():
    kwargs = dict(model="smollm2-135m", device="cuda", dtype="float32", kv_memory="1GiB", max_model_len=2048)
    return turnkv.LLM(cuda_graphs=True, **kwargs), turnkv.LLM(cuda_graphs=False, **kwargs)


def _prompts(n, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(length),), generator=gen).tolist()
            for length in torch.randint(5, 300, (n,), generator=gen)]


@pytest.mark.parametrize("batch", [1, 3, 5])  # 3 and 5 run in padded buckets (4 and 8)
def test_batched_decode_matches_eager(engines, batch):
    graphed, eager = engines
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    prompts = _prompts(batch, graphed.config.vocab_size, seed=batch)
    a = graphed.generate(prompts, max_new_tokens=24)
    b = eager.generate(prompts, max_new_tokens=24)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids


def test_logits_match_eager_step(engines):
    graphed, eager = engines
    from turnkv.kv.sequence import SequenceKV

    prompt = _prompts(1, graphed.config.vocab_size, seed=11)[0]
    outs = []
    for llm in engines:
        seq = SequenceKV(llm.pool)
        llm.runner.prefill(seq, prompt)
        steps = [llm.runner.decode([seq], llm._token_tensor([t])) for t in (5, 17, 99)]
        outs.append(torch.stack(steps))
        seq.free()
    torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=2e-4)


def test_decode_schedule_with_observation_window_matches_eager(engines):
    """SnapKV compressing during decode scores with a window of decode queries; the graph hands each
    step's queries to the window after its replay."""
    prompts = _prompts(3, engines[0].config.vocab_size, seed=5)
    recipe = "snapkv budget=64 schedule=decode every=8"
    a, b = (llm.generate(prompts, recipe=recipe, max_new_tokens=40) for llm in engines)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_pool_pages_return_after_generation(engines):
    graphed, _ = engines
    before = graphed.pool.bytes_in_use()
    graphed.generate(_prompts(4, graphed.config.vocab_size, seed=9), max_new_tokens=8)
    assert graphed.pool.bytes_in_use() == before



def test_streaming_heads_page_ring_matches_eager(engines):
    """Streaming heads drop their ring's oldest page every 16 steps (SequenceKV.drop_pages): the
    graph's tables get the shifted cells before the step (a second asynchronous upload), and the
    batch decodes the eager step's tokens, then its logits step by step."""
    prompts = _prompts(3, engines[0].config.vocab_size, seed=21)
    recipe = "prefill=streaming_heads(pattern=random,sink=16,local=32)"
    a, b = (llm.generate(prompts, recipe=recipe, max_new_tokens=70) for llm in engines)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    from turnkv.kv.sequence import SequenceKV
    from turnkv.methods.recipe import Recipe

    r = Recipe.parse(recipe)
    outs = []
    for llm in engines:
        st = r.new_state(llm.config.num_layers)
        seq = SequenceKV(llm.pool)
        llm.runner.prefill(seq, prompts[0] * 2, context=st.context)
        r.prefill.trim(seq)
        steps = []
        for t in range(48):
            steps.append(llm.runner.decode([seq], llm._token_tensor([5 + t])))
            r.prefill.trim(seq)
        outs.append(torch.stack(steps))
        assert seq.table_edits.any()  # pages were dropped
        seq.free()
    torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=2e-4)
