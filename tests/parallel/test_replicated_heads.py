"""More ranks than KV heads: a model with one KV head at N=2, where both ranks hold the KV head and
each holds half of its query heads."""

from __future__ import annotations

import pytest

from tests.conftest import save_tiny
from tests.parallel.conftest import engine_pair, three_turns
from turnkv.errors import InvalidRequestError

STREAMING = "prefill=streaming_heads(pattern=random,sink=4,local=16,prefill_local=16)"
# Per query head decisions, which each rank makes for its own query heads.
RECIPES = [
    "full",
    "quest decode=quest(budget=32,dense_layers=0)",
    STREAMING + " decode=lserve(budget=32,physical_page=16,logical_page=16)",
    "loopserve-d decode=loopserve(budget=16,warmup=2,interval=4)",
]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("tiny-chat-one-kv-head")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer, num_key_value_heads=1)
    yield from engine_pair(path, "8MiB", "8MiB")


def test_both_ranks_hold_the_kv_head(replicated):
    _, pair = replicated
    assert pair.config.num_kv_heads == 1 and pair.config.num_heads == 2  # of the model's 1 and 4
    assert pair.model.shard.replicas == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_match_one(replicated, recipe):
    """The same tokens, and both replicas keep N=1's positions (kept() checks that replicas agree)."""
    single, pair = replicated
    assert three_turns(pair, recipe) == three_turns(single, recipe)


@pytest.mark.parametrize("recipe, reason", [
    ("snapkv keep_ratio=0.5", "evict=snapkv"),
    ("lserve-dynamic decode=lserve(group=max)", "decode=lserve"),
    ("loopserve-d decode=loopserve(granularity=kv)", "decode=loopserve"),
])
def test_a_decision_over_a_split_query_group_is_refused(replicated, recipe, reason):
    _, pair = replicated
    with pytest.raises(InvalidRequestError, match=f"splits each .* {reason}"):
        pair.conversation(recipe=recipe)
    assert three_turns(pair, "full") == three_turns(replicated[0], "full")  # the engine goes on
