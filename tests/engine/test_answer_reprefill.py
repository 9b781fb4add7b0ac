"""answer=reprefill (LoopServe): the previous reply's decode-time KV is dropped and the reply
is prefilled again with the next message, through the recipe's prefill pattern."""

from __future__ import annotations

import pytest

from turnkv.errors import InvalidRequestError
from turnkv.methods.recipe import Recipe

MESSAGES = ["Tell me about harbours and the ships in them.", "And the lighthouses?", "Which came first?"]


def converse(llm, recipe: str) -> list:
    conv = llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        return [conv.send(m, max_new_tokens=6, temperature=0) for m in MESSAGES], conv.turns, conv.method_stats
    finally:
        conv.close()


def test_the_reply_is_prefilled_again_and_dense_replies_do_not_change(chat_llm):
    kept, kept_turns, _ = converse(chat_llm, "full")
    again, turns, _ = converse(chat_llm, "full answer=reprefill")
    assert [r.token_ids for r in again] == [r.token_ids for r in kept]
    for i in (1, 2):
        previous = turns[i - 1]
        # Reused up to the end of the previous prompt; the reply is prefilled with the new message.
        assert again[i].cached_tokens == previous.prompt_end
        assert kept[i].cached_tokens > previous.prompt_end  # keep reuses (most of) the reply's decode-time KV
        assert again[i].cached_tokens + again[i].prompt_tokens == kept[i].cached_tokens + kept[i].prompt_tokens
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()


def test_a_prefill_pattern_covers_the_reprefilled_reply(chat_llm):
    *_, kept_stats = converse(chat_llm, "prefill=a_shape(sink=2, local=8)")
    *_, stats = converse(chat_llm, "prefill=a_shape(sink=2, local=8) answer=reprefill")
    # More rows go through the pattern in turns 2 and 3, so its cell counts, and density, change.
    assert [s["prefill"]["density"] for s in stats[1:]] != [s["prefill"]["density"] for s in kept_stats[1:]]


def test_the_switch_parses_prints_and_rejects_bad_values():
    recipe = Recipe.parse("loopserve answer=reprefill")
    assert recipe.answer == "reprefill" and str(recipe).endswith("answer=reprefill")
    assert Recipe.parse(str(recipe)) == recipe
    assert "answer" not in str(Recipe.parse("loopserve"))
    with pytest.raises(InvalidRequestError, match="keep' or 'reprefill"):
        Recipe.parse("full answer=sometimes")
