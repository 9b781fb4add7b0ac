"""Recipe keys as keyword arguments wherever a recipe is taken (LLM, conversation, generate), with the
string form's meaning and validation; the public API documented, its internals private."""

from __future__ import annotations

import inspect
import re

import pytest

import turnkv
from turnkv.methods.recipe import RECIPE_KEYS, Recipe


@pytest.mark.parametrize("keywords,string", [
    ({"recipe": "ada-snapkv", "budget": 64}, "ada-snapkv budget=64"),
    ({"recipe": "snapkv", "keep_ratio": 0.25, "turns": "flowkv"}, "snapkv keep_ratio=0.25 turns=flowkv"),
    ({"evict": "snapkv(window=16)+adakv", "budget": 48, "schedule": "turn_end"},
     "evict=snapkv(window=16)+adakv budget=48 schedule=turn_end"),
    ({"recipe": "h2o", "compression_ratio": 0.75}, "h2o compression_ratio=0.75"),
    ({"prefill": {"name": "a_shape", "sink": 4, "local": 8}, "state": "recompute"},
     "prefill=a_shape(sink=4,local=8) state=recompute"),
    ({"recipe": {"preset": "snapkv", "budget": 32}, "turns": "flowkv"}, "snapkv budget=32 turns=flowkv"),
])
def test_conversation_keywords_mean_what_the_string_says(chat_llm, keywords, string):
    conv = chat_llm.conversation(**keywords)
    assert str(conv.recipe) == str(Recipe.parse(string))
    conv.close()


@pytest.mark.parametrize("keywords,message", [
    ({"recipe": "ada-snapkv", "budget": -5}, "budget must be an integer >= 1"),
    ({"recipe": "ada-snapkv", "budget": 2.5}, "budget must be an integer >= 1"),
    ({"recipe": "snapkv", "keep_ratio": 2}, "keep_ratio must be a number in (0, 1]"),
    ({"budget": 64}, "this recipe evicts nothing"),
    ({"recipe": "snapkv", "budgte": 64}, "unknown recipe option 'budgte'"),
    ({"recipe": "snapkv", "turns": "flowkv", "schedule": "decode"}, "flowkv keeps the running turn whole"),
    ({"recipe": 3}, "a recipe is a Recipe, a string, a file path or a mapping"),
])
def test_keywords_are_validated_as_the_string_form(chat_llm, keywords, message):
    with pytest.raises(turnkv.InvalidRequestError, match=re.escape(message)):
        chat_llm.conversation(**keywords)


def test_engine_default_recipe_from_keywords_and_overrides_of_it(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", recipe="ada-snapkv", budget=24)
    assert str(llm.recipe) == str(Recipe.parse("ada-snapkv budget=24"))
    # A conversation's keywords apply over the engine's default recipe.
    assert llm.conversation(keep_ratio=0.5).recipe.evict.keep_ratio == 0.5
    assert str(llm.conversation().recipe) == str(llm.recipe)


def test_an_unknown_engine_argument_fails_before_the_model_loads():
    with pytest.raises(turnkv.InvalidRequestError, match="unknown argument 'kv_memroy'"):
        turnkv.LLM("no-such-model", kv_memroy="1GiB")


def test_generate_takes_recipe_keywords_beside_sampling(chat_llm):
    prompt = " ".join(f"w{i}" for i in range(60))
    by_keywords = chat_llm.generate(prompt, recipe="snapkv", budget=8, max_new_tokens=3)
    by_string = chat_llm.generate(prompt, recipe="snapkv budget=8", max_new_tokens=3)
    full = chat_llm.generate(prompt, max_new_tokens=3)
    assert by_keywords.token_ids == by_string.token_ids and by_keywords.kv_tokens == by_string.kv_tokens
    assert by_keywords.kv_tokens < full.kv_tokens
    with pytest.raises(turnkv.InvalidRequestError, match="unknown sampling option 'temprature'"):
        chat_llm.generate(prompt, temprature=0.5)


PUBLIC = {
    turnkv.LLM: {"conversation", "encode", "generate", "info", "kv_bytes_per_token", "prefix_cache_bytes", "resolve_recipe",
                 "resume", "shutdown"},
    turnkv.Conversation: {"clone", "close", "compression_log", "from_record", "kv_bytes", "kv_sharing", "location",
                          "method_stats", "offload", "reset", "segment_counts", "send", "stream", "to_record"},
}


def test_the_public_api_is_documented_and_internals_are_private():
    for cls, names in PUBLIC.items():
        assert {n for n in dir(cls) if not n.startswith("_")} == names, cls
        assert inspect.getdoc(cls), cls
        for name in names:
            assert inspect.getdoc(getattr(cls, name)), f"{cls.__name__}.{name}"
    # The keywords a turn and the recipe take are spelled out where help() shows them.
    for field in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"):
        for doc in (turnkv.SamplingParams.__doc__, turnkv.Conversation.send.__doc__, turnkv.LLM.generate.__doc__):
            assert field in doc, field
    for key in RECIPE_KEYS:
        assert key in Recipe.of.__doc__, key
    for word in ("system", "recipe", "budget"):
        assert word in turnkv.LLM.conversation.__doc__
    for mode in ('"turns"', '"system"', '"off"'):  # LLM(prefix_cache=...)
        assert mode in turnkv.LLM.__doc__
