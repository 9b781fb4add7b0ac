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


CONFIG = dict(recipes=RECIPES, positions=("begin", "end"), max_new_tokens=6)
# Every field of a record that the free run or the recipe's bookkeeping decides.
SAME = ("tokens", "response", "kv_bytes", "history_tokens", "first_divergence", "score", "prefilled_tokens", "density")


def _by_key(records):
    return {(r["instance"], r["recipe"], r["turn"]): r for r in records}


@pytest.fixture(scope="module", autouse=True)
def no_prefix_cache(chat_llm):
    """Records count the tokens each conversation prefilled, which a system prompt cached by an
    earlier conversation shortens: the paths compared here run with the engine's prefix index off."""
    index, chat_llm.prefix_index = chat_llm.prefix_index, None
    if index is not None:
        index.clear()
    yield
    chat_llm.prefix_index = index


@pytest.fixture(scope="module")
def alone(chat_llm, tmp_path_factory):
    """Every conversation on its own through Conversation.send: the engine's path."""
    path = tmp_path_factory.mktemp("alone") / "r.jsonl"
    return _by_key(run_quality(chat_llm, instances(), QualityConfig(**CONFIG, lockstep=False), path, progress=False))


def _agreement_close(a, b, answer_tokens):
    """Teacher-forced agreement may differ by one token where a forced answer prefilled as one chunk
    (or a batched step) flips the argmax between two near-tied tokens; the KL bound beside it says the
    distributions are otherwise the same."""
    return a == b or abs(a - b) <= 1 / answer_tokens + 1e-9


def test_lockstep_at_batch_one_is_the_engines_path(chat_llm, alone, tmp_path):
    # One conversation per forward, as the engine decodes it: every free run is the same computation
    # (the shared first prompt is bit-identical, forks copy the state exactly), so the same tokens.
    one = _by_key(run_quality(chat_llm, instances(), QualityConfig(**CONFIG, batch=1, max_batch=1),
                              tmp_path / "b.jsonl", progress=False))
    assert alone.keys() == one.keys() and len(alone) == 2 * (len(RECIPES) + 1) * 3
    for key, a in alone.items():
        b = one[key]
        for field in SAME:
            assert a.get(field) == b.get(field), (key, field)
        full = alone[(key[0], "full", key[2])]
        assert _agreement_close(a["agreement"], b["agreement"], len(full["tokens"])), key
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5), key
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()


def _logprobs_at(llm, inst, recipe, answers, turn):
    """The engine's log-probs along answers[turn], the earlier turns fed answers[:turn]."""
    conv = llm.conversation(system=inst.system, recipe=recipe)
    try:
        for t in range(turn):
            conv.send(inst.turns[t].message(), force=answers[t])
        return conv.send(inst.turns[turn].message(), force=answers[turn], logprobs=True).logprobs
    finally:
        conv.close()


def test_batched_lockstep_differs_from_the_engines_path_only_at_near_ties(chat_llm, alone, tmp_path):
    # A batched step rounds differently from one row alone (about 1e-6 relative), which may flip a
    # greedy choice between two near-tied tokens. Where a conversation's tokens differ, the engine's own
    # log-probs at the first differing token must show such a tie; everything else must match.
    together = _by_key(run_quality(chat_llm, instances(), QualityConfig(**CONFIG, batch=5, max_batch=4),
                                   tmp_path / "b.jsonl", progress=False))
    assert alone.keys() == together.keys()
    placed = {i.id: i for i in (inst.with_position(p) for inst in instances() for p in CONFIG["positions"])}
    recipes = {"full": "full", **RECIPES}
    conversations = {(k[0], k[1]) for k in alone}
    differing = set()
    for instance, name in sorted(conversations):
        turns = range(len(placed[instance].turns))
        a = [alone[(instance, name, t)]["tokens"] for t in turns]
        b = [together[(instance, name, t)]["tokens"] for t in turns]
        if a == b:
            continue
        differing.add((instance, name))
        t = next(t for t in turns if a[t] != b[t])
        d = next((i for i, (x, y) in enumerate(zip(a[t], b[t])) if x != y), None)
        assert d is not None, (instance, name, t)  # one a prefix of the other: an EOS, not a tie
        logprobs = _logprobs_at(chat_llm, placed[instance], recipes[name], b, t)
        gap = float(logprobs[d, a[t][d]] - logprobs[d, b[t][d]])
        assert 0 <= gap < 1e-3, (instance, name, t, d, gap)
    assert len(differing) <= len(conversations) // 10, differing
    for key, a in alone.items():
        if (key[0], key[1]) in differing or (key[0], "full") in differing:
            continue  # a different history (or reference) from the tie on: nothing left to compare
        b = together[key]
        for field in SAME:
            assert a.get(field) == b.get(field), (key, field)
        full = alone[(key[0], "full", key[2])]
        assert _agreement_close(a["agreement"], b["agreement"], len(full["tokens"])), key
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5), key
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()


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
            turn.abandon()
        own.close()
        copied.close()
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()


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
