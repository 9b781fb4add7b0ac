"""The server and turn ends in the prefix index: a request whose history no kept conversation extends
(another client's, or several at once) takes the longest indexed turn end instead of prefilling it,
and replies what a server without the index replies."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import turnkv
from tests.serve.conftest import MODEL, running

SYSTEM = "You are terse. Answer in a few words. " * 4
ASKED = ["What is the sea?", "And a mountain?"]
ANSWERS = ["The sea is salt water.", "A mountain is a high hill."]


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    return {mode: turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", prefix_cache=mode)
            for mode in ("turns", "off")}


def _history(llm):
    """Earlier turns computed elsewhere on the engine (a library conversation), with replies that render
    back to the same token ids; returns (their messages, the tokens their last turn end holds)."""
    conv = llm.conversation(system=SYSTEM)
    for message, answer in zip(ASKED, ANSWERS):
        conv.send(message, force=llm.tokenizer.encode(answer, add_special_tokens=False), max_new_tokens=32)
    messages, turn_end = list(conv.messages), conv.kv.next_position
    conv.close()
    return messages, turn_end


def _ask(server, messages):
    r = server.client().chat.completions.create(messages=messages, model=MODEL, max_tokens=6, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_requests_carrying_earlier_turns_take_them_from_the_index(engines):
    out = {}
    for mode, llm in engines.items():
        messages, turn_end = _history(llm)
        # Two clients branch off the same history at once, each with its own question: neither extends
        # a kept conversation (the store keeps a conversation's first prompt for its own client).
        requests = [messages + [{"role": "user", "content": q}] for q in ("And a river?", "And a lake?")]
        with running(llm, served_model_name=MODEL) as server:
            hits = llm.prefix_index.hits if llm.prefix_index is not None else 0
            before = server.metric("vllm:prefix_cache_hits_total")
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda request: _ask(server, request), requests))
            expected = turn_end if mode == "turns" else 0
            assert [cached for _, cached in answers] == [expected, expected]
            assert server.metric("vllm:prefix_cache_hits_total") - before == 2 * expected
            if mode == "turns":
                assert llm.prefix_index.hits - hits == 2
        out[mode] = [text for text, _ in answers]
    assert out["turns"] == out["off"]
