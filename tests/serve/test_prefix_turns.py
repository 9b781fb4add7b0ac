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


def indexed_history(llm):
    """Earlier turns computed elsewhere on the engine (a library conversation), with replies that render
    back to the same token ids; returns (their messages, the tokens their last turn end holds)."""
    conv = llm.conversation(system=SYSTEM)
    for message, answer in zip(ASKED, ANSWERS):
        conv.send(message, force=llm.tokenizer.encode(answer, add_special_tokens=False), max_new_tokens=32)
    messages, turn_end = list(conv.messages), conv.kv.next_position
    conv.close()
    return messages, turn_end


def ask(server, messages):
    r = server.client().chat.completions.create(messages=messages, model=MODEL, max_tokens=6, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_requests_carrying_earlier_turns_take_them_from_the_index(engines):
    out = {}
    for mode, llm in engines.items():
        messages, turn_end = indexed_history(llm)
        # Two clients branch off the same history at once, each with its own question: neither extends
        # a kept conversation (the store keeps a conversation's first prompt for its own client).
        requests = [messages + [{"role": "user", "content": q}] for q in ("And a river?", "And a lake?")]
        with running(llm, served_model_name=MODEL) as server:
            hits = llm.prefix_index.hits if llm.prefix_index is not None else 0
            before = server.metric("vllm:prefix_cache_hits_total")
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda request: ask(server, request), requests))
            expected = turn_end if mode == "turns" else 0
            assert [cached for _, cached in answers] == [expected, expected]
            assert server.metric("vllm:prefix_cache_hits_total") - before == 2 * expected
            if mode == "turns":
                assert llm.prefix_index.hits - hits == 2
        out[mode] = [text for text, _ in answers]
    assert out["turns"] == out["off"]


def test_no_reuse_prefills_every_token_of_every_request(engines):
    """--no-reuse is the from-scratch baseline: no request takes KV it did not prefill itself, neither
    from a kept conversation nor from the prefix index (which holds this history and system prompt),
    and its requests add nothing to the index."""
    llm = engines["turns"]
    messages, turn_end = indexed_history(llm)  # the index now holds the system prompt and both turn ends
    branch = messages + [{"role": "user", "content": "And a river?"}]
    with running(llm, served_model_name=MODEL) as reusing:  # the same request where reuse is on
        assert ask(reusing, branch)[1] == turn_end > 0
    entries, index_bytes, hits = len(llm.prefix_index), llm.prefix_cache_bytes(), llm.prefix_index.hits
    with running(llm, served_model_name=MODEL, reuse=False) as server:
        client, usages, replies = server.client(), [], []
        for _ in range(2):  # the same history twice, then a conversation of three turns over the same system prompt
            text, cached = ask(server, branch)
            replies.append(text)
            usages.append(cached)
        chat = [{"role": "system", "content": SYSTEM}]
        for question in ("What is the sea?", "And a mountain?", "And a lake?"):
            chat.append({"role": "user", "content": question})
            r = client.chat.completions.create(messages=chat, model=MODEL, max_tokens=6, temperature=0)
            usages.append(r.usage.prompt_tokens_details.cached_tokens)
            chat.append({"role": "assistant", "content": r.choices[0].message.content})
        chunks = list(client.chat.completions.create(messages=chat + [{"role": "user", "content": "Why?"}],
                                                     model=MODEL, max_tokens=4, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
        assert usages == [0] * 6
        assert server.metric("vllm:prefix_cache_hits_total") == 0
        assert server.metric("turnkv:reused_tokens_total") == 0
        assert server.metric("turnkv:prefilled_tokens_total") == server.metric("vllm:prompt_tokens_total") > 0
        assert server.metric("turnkv:stored_conversations") == 0
    assert (len(llm.prefix_index), llm.prefix_cache_bytes(), llm.prefix_index.hits) == (entries, index_bytes, hits)
    # What it replies is what a server without any index replies.
    off = engines["off"]
    with running(off, served_model_name=MODEL, reuse=False) as plain:
        assert [ask(plain, branch)[0] for _ in range(2)] == replies
