"""N=2 over gloo on CPU (fp32, a tiny random chat model) gives the tokens of N=1 over three turns, and
keeps the same (layer, KV head, position) sets, for each recipe below."""

from __future__ import annotations

import pytest
import torch

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from tests.parallel.conftest import three_turns
from turnkv.parallel.kept import kept

# Small windows and budgets, so that each method acts on turns of about 60 tokens.
STREAMING = "prefill=streaming_heads(pattern=random,ratio={ratio},sink=4,local=16,prefill_local=16)"
RECIPES = [
    "full",
    "snapkv keep_ratio=0.5",
    "pyramidkv keep_ratio=0.5",
    "streaming-llm budget=32",
    "h2o keep_ratio=0.5",
    "knorm keep_ratio=0.5",
    "expected-attention keep_ratio=0.5",
    # Layer-wide allocation: the scores of every rank's heads are gathered (methods/evict/across_ranks.py).
    "ada-snapkv keep_ratio=0.5",
    "ada-pyramidkv keep_ratio=0.5",
    "ada-expected-attention keep_ratio=0.5",
    "flowkv keep_ratio=0.5",
    "flowkv-ada-snapkv keep_ratio=0.5",
    # Streaming heads: each rank takes its heads' columns of the whole model's random pattern. At 0.75
    # a layer mixes streaming and dense heads, so the columns must be the rank's own.
    STREAMING.format(ratio=0.5) + " decode=lserve(budget=32,physical_page=16,logical_page=16)",
    STREAMING.format(ratio=0.75),
    "loopserve-d decode=loopserve(budget=16,warmup=2,interval=4)",
    "quest decode=quest(budget=32,dense_layers=0)",
    "lserve-dynamic decode=lserve(budget=32,physical_page=16,logical_page=16,group=max)",
    "tova keep_ratio=0.5 evict=tova(group=kv_head)",
    # Layer-wide scores: TOVA's mean over every query head of the layer, random's draw over every head.
    "tova keep_ratio=0.5",
    "random keep_ratio=0.5",
]
# Sparse prefill patterns, each of which changes the replies of the full cache on these turns.
PATTERNS = [
    "loopserve-p prefill=loopserve(dense_above=None)",  # the lines everywhere
    "loopserve prefill=loopserve(dense_above=0.5) decode=loopserve(budget=16,warmup=2,interval=4)",
    "prefill=a_shape(sink=4,local=16)",
    "prefill=tri_shape(sink=4,local=16,last=8)",
    "prefill=minference(vertical=8,slash=16,last=8,force_sink=2,force_local=4)",
]
RECIPES += PATTERNS


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_match_one(tp_engines, recipe):
    single, pair = tp_engines
    tokens_1, kept_1 = three_turns(single, recipe)
    tokens_2, kept_2 = three_turns(pair, recipe)
    assert tokens_2 == tokens_1
    assert kept_2 == kept_1
    assert len(kept_1) == single.config.num_layers * single.config.num_kv_heads  # every head compared


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("recipe", ["full", "ada-snapkv keep_ratio=0.5", "snapkv keep_ratio=0.5 state=krul"])
def test_a_trip_to_a_tier_and_back(tp_engines, recipe, tier):
    """Each rank stores its shard of the conversation under the conversation's id, and brings it back."""
    single, pair = tp_engines
    assert three_turns(pair, recipe, offload=tier) == three_turns(single, recipe, offload=tier)


def test_an_engine_started_again_continues_a_stored_conversation(tp_engines, chat_model_dir):
    """A conversation stored on disk by an engine at N=2 is continued by a new engine at N=2 over the same
    folder (each rank reads its own shard), as N=1 would have continued it."""
    import turnkv

    single, pair = tp_engines
    recipe = "ada-snapkv keep_ratio=0.5"
    ref = single.conversation(system=SYSTEM, recipe=recipe)
    expected = [ref.send(m, max_new_tokens=NEW, ignore_eos=True).token_ids for m in MESSAGES[:2]]
    conv = pair.conversation(system=SYSTEM, recipe=recipe)
    assert conv.send(MESSAGES[0], max_new_tokens=NEW, ignore_eos=True).token_ids == expected[0]
    assert conv.offload("disk") == "disk"
    again = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", tensor_parallel=2,
                       state_disk_dir=pair.disk_dir)
    try:
        resumed = again.resume(conv.id)
        assert resumed.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids == expected[1]
        assert kept(resumed) == kept(ref)
    finally:
        again.shutdown()
        ref.close()


def test_the_recipes_act(tp_engines):
    """The compressing recipes above drop tokens (the comparison is not of full caches), and the mixed
    streaming pattern holds different counts within a layer."""
    single, _ = tp_engines
    _, full = three_turns(single, "full")
    _, snap = three_turns(single, "ada-snapkv keep_ratio=0.5")
    _, mixed = three_turns(single, STREAMING.format(ratio=0.75))
    held = lambda kept: {key: len(positions) for key, positions in kept.items()}  # noqa: E731
    assert sum(held(snap).values()) < 0.75 * sum(held(full).values())
    assert len(set(held(snap).values())) > 1  # Ada-KV gave heads different budgets
    layers = {layer for layer, _ in mixed}
    assert any(len({n for (l, _), n in held(mixed).items() if l == layer}) > 1 for layer in layers)
    full_tokens = three_turns(single, "full")[0]
    assert all(three_turns(single, recipe)[0] != full_tokens for recipe in PATTERNS)


def test_the_prefix_index_serves_every_rank(tp_engines):
    """The engines keep the prefix index on: a new conversation takes the system prompt from it, on
    every rank alike (the tests above compare conversations that do)."""
    _, pair = tp_engines
    three_turns(pair, "full")
    conv = pair.conversation(system=SYSTEM)
    assert conv.send(MESSAGES[0], max_new_tokens=2).cached_tokens > 0
    conv.close()


def test_logprobs_agree(tp_engines):
    """The log-probabilities of each step differ from N=1's by float rounding only (the all-reduce adds
    the heads' partial sums in another order)."""
    single, pair = tp_engines
    out = []
    for llm in (single, pair):
        conv = llm.conversation(system=SYSTEM)
        out.append([conv.send(m, max_new_tokens=4, ignore_eos=True, logprobs=True).logprobs for m in MESSAGES[:2]])
        conv.close()
    for a, b in zip(*out):
        assert a.shape == b.shape == (4, single.config.vocab_size)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


def test_a_batch_of_prompts(tp_engines):
    """LLM.generate decodes prompts of different lengths as one batch on every rank."""
    single, pair = tp_engines
    prompts = [list(range(5, 40)), list(range(100, 117)), list(range(300, 361))]
    for recipe in ("full", "ada-snapkv budget=12"):
        expected = [r.token_ids for r in single.generate(prompts, recipe=recipe, max_new_tokens=6, ignore_eos=True)]
        got = [r.token_ids for r in pair.generate(prompts, recipe=recipe, max_new_tokens=6, ignore_eos=True)]
        assert got == expected


def test_sampling(tp_engines):
    """A seeded sample is N=1's; an unseeded one is drawn alike on every rank (rank 0 picks the seed),
    so the engine goes on."""
    single, pair = tp_engines
    prompt = list(range(7, 30))
    seeded = dict(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=1234)
    assert pair.generate(prompt, **seeded).token_ids == single.generate(prompt, **seeded).token_ids
    assert len(pair.generate(prompt, max_new_tokens=8, ignore_eos=True, temperature=1.0).token_ids) == 8
    assert pair.generate(prompt, max_new_tokens=4).token_ids == single.generate(prompt, max_new_tokens=4).token_ids


def test_clone_and_reset(tp_engines):
    """A clone is made on every rank and known by one id; a reset forgets every rank's shard."""
    runs = []
    for llm in tp_engines:
        conv = llm.conversation(system=SYSTEM, recipe="ada-snapkv keep_ratio=0.5")
        tokens = [conv.send(MESSAGES[0], max_new_tokens=NEW, ignore_eos=True).token_ids]
        twin = conv.clone()
        tokens.append(twin.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids)
        tokens.append(conv.send(MESSAGES[2], max_new_tokens=NEW, ignore_eos=True).token_ids)
        twin_kept = kept(twin)
        conv.reset()
        tokens.append(conv.send(MESSAGES[0], max_new_tokens=NEW, ignore_eos=True).token_ids)
        runs.append((tokens, twin_kept, kept(conv)))
        twin.close()
        conv.close()
    assert runs[1] == runs[0]
    assert runs[0][0][3] == runs[0][0][0]  # after the reset, the first turn again
