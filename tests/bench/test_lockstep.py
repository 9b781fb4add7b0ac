"""The batched quality runner (turnkv/bench/lockstep.py) against the engine's own conversations:
batched decode, forced answers prefilled as one chunk, forks at the first divergence and the shared
first prompt must give what one conversation at a time gives, up to float rounding."""

from __future__ import annotations

import pytest
import torch

from turnkv.bench.lockstep import LockstepConversation, SharedPrompt, chunkable
from turnkv.bench.quality import QualityConfig, run_quality
from turnkv.methods.recipe import Recipe

from test_quality import instances

# One of every path: plain eviction under both policies, H2O's accumulation, a decode selection of
# each kind (Quest's and LoopServe's fork mid-turn, LServe's runs its forced twin from the start),
# streaming heads trimmed every step, sparse prefills, Ada-KV, a scorer with its own window.
RECIPES = {
    "snap": "snapkv budget=8", "snap-flow": "snapkv budget=8 turns=flowkv", "h2o": "h2o budget=8",
    "sl": "streaming-llm keep_ratio=0.3", "ada": "ada-snapkv keep_ratio=0.3", "ea": "expected-attention budget=8",
    "quest": "quest decode=quest(budget=16, dense_layers=0)", "lserve-d": "lserve-dynamic decode=lserve(budget=64)",
    "loop-d": "loopserve-d decode=loopserve(budget=8, warmup=2, interval=2)",
    "duo": "duo-attention prefill=streaming_heads(pattern=random, sink=4, local=8)",
    "ashape": "a-shape prefill=a_shape(sink=4, local=8)", "loop-p": "loopserve-p",
}


def _by_key(records):
    return {(r["instance"], r["recipe"], r["turn"]): r for r in records}


def test_lockstep_gives_what_one_conversation_at_a_time_gives(chat_llm, tmp_path):
    config = dict(recipes=RECIPES, positions=("begin", "end"), max_new_tokens=6)
    alone = _by_key(run_quality(chat_llm, instances(), QualityConfig(**config, lockstep=False), tmp_path / "a.jsonl",
                                progress=False))
    together = _by_key(run_quality(chat_llm, instances(), QualityConfig(**config, batch=5, max_batch=4),
                                   tmp_path / "b.jsonl", progress=False))
    assert alone.keys() == together.keys() and len(alone) == 2 * (len(RECIPES) + 1) * 3
    for key, a in alone.items():
        b = together[key]
        for field in ("tokens", "response", "kv_bytes", "history_tokens", "first_divergence", "agreement", "score",
                      "prefilled_tokens", "density"):
            assert a.get(field) == b.get(field), (key, field)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5), key
    assert chat_llm.pool.bytes_in_use() == 0


def _forced_logprobs(llm, recipe, messages, answers):
    conv = llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        return [conv.send(m, force=a, logprobs=True).logprobs for m, a in zip(messages, answers)]
    finally:
        conv.close()


@pytest.mark.parametrize("recipe", ["snapkv budget=8", "h2o budget=8", "a-shape prefill=a_shape(sink=4, local=8)"])
def test_a_forced_answer_prefilled_as_one_chunk_equals_feeding_it_token_by_token(chat_llm, recipe):
    assert chunkable(Recipe.parse(recipe))
    messages = [t.message() for t in instances()[0].turns]
    full = chat_llm.conversation(system="Answer briefly.")
    answers = [full.send(m, max_new_tokens=7).token_ids for m in messages]
    full.close()
    stepwise = _forced_logprobs(chat_llm, recipe, messages, answers)
    conv = LockstepConversation(chat_llm, "Answer briefly.", recipe)
    chunked = []
    for m, a in zip(messages, answers):
        turn = conv.begin(m, len(a), force=a, logprobs=True)
        assert turn.gen.done  # the whole answer went in with the prompt's forward and one chunk
        turn.finish()
        chunked.append(conv.last_reply.logprobs)
    kv_tokens = conv.kv.tokens()
    conv.close()
    reference = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    for m, a in zip(messages, answers):
        reference.send(m, force=a)
    assert kv_tokens == reference.kv.tokens()  # the same KV kept, turn after turn
    reference.close()
    for s, c, a in zip(stepwise, chunked, answers):
        assert s.shape == c.shape == (len(a), s.shape[1])
        assert torch.equal(s.argmax(-1), c.argmax(-1))
        p = s.double().exp()
        assert float((p * (s.double() - c.double())).sum(-1).abs().max()) < 1e-5  # KL ~ float rounding
        torch.testing.assert_close(c, s, atol=1e-4, rtol=1e-4)
    assert not chunkable(Recipe.parse("quest")) and not chunkable(Recipe.parse("duo-attention"))
    assert not chunkable(Recipe.parse("snapkv budget=8 schedule=decode every=4"))


def test_a_shared_first_prompt_is_bit_identical_to_prefilling_it(chat_llm):
    inst = instances()[0]
    message = inst.turns[0].message()
    shared = SharedPrompt(chat_llm)
    for recipe in ("snapkv budget=8", "h2o budget=8", "full", "snapkv budget=8"):  # the last one from the cache
        own, copied = (LockstepConversation(chat_llm, inst.system, recipe) for _ in range(2))
        first = [own.begin(message, 5, logprobs=True), copied.begin(message, 5, logprobs=True, shared=shared)]
        assert torch.equal(first[0].gen.logprobs[0], first[1].gen.logprobs[0])
        a, b = own.kv, copied.kv  # the prompt, compressed by the recipe's after-prompt hook
        assert (a.lengths == b.lengths).all() and a.next_position == b.next_position
        for layer in range(chat_llm.config.num_layers):
            for x, y in zip(a.gather(layer), b.gather(layer)):
                assert torch.equal(x, y)
            assert torch.equal(a.gather_attention_mass(layer), b.gather_attention_mass(layer))
        wa, wb = own.method_state.window, copied.method_state.window
        if wa is not None:
            assert all(torch.equal(x, y) for x, y in zip(wa.queries, wb.queries))
            assert all(torch.equal(x, y) for x, y in zip(wa.positions, wb.positions))
        for turn in first:
            turn.abort()
        own.close()
        copied.close()
    assert chat_llm.pool.bytes_in_use() == 0


def test_workers_split_the_recipes_and_give_the_same_records(chat_model_dir, chat_llm, tmp_path):
    recipes = {k: RECIPES[k] for k in ("snap", "h2o", "quest", "ashape")}
    config = dict(recipes=recipes, positions=("end",), max_new_tokens=5, batch=2)
    one = _by_key(run_quality(chat_llm, instances(), QualityConfig(**config), tmp_path / "a.jsonl", progress=False))
    engine = dict(model=str(chat_model_dir), device="cpu", kv_memory="64MiB")
    two = run_quality(chat_llm, instances(), QualityConfig(**config, workers=2, engine=engine), tmp_path / "b.jsonl",
                      progress=False)
    assert len(two) == len(one) and len((tmp_path / "b.jsonl").read_text().splitlines()) == len(one)
    for key, b in _by_key(two).items():
        assert b["tokens"] == one[key]["tokens"] and b["agreement"] == one[key]["agreement"]
        assert b["kl"] == pytest.approx(one[key]["kl"], abs=1e-5)
