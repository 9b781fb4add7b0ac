"""POST /flush_cache frees what the server keeps between requests, as SGLang's endpoint does: every
idle conversation and every entry of the prefix index. A running request goes on untouched, and
/metrics shows the pool empty once nothing runs."""

from __future__ import annotations

import json

import httpx

from tests.serve.conftest import MODEL, running, stream_in_background, wait_for

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 3}


def ask(server, question: str, max_tokens: int = 6) -> tuple[str, int]:
    r = server.client().chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                                messages=[SYSTEM, {"role": "user", "content": question}])
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def pool_metrics(server) -> dict[str, float]:
    return {name: server.metric(name) for name in ("turnkv:kv_pool_bytes_used", "turnkv:prefix_cache_bytes",
                                                   "turnkv:stored_conversations", "turnkv:stored_kv_bytes",
                                                   "vllm:kv_cache_usage_perc")}


def test_a_flush_frees_idle_conversations_and_the_prefix_index(chat_model_dir):
    import turnkv

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB")  # its pool is this test's alone
    with running(llm, served_model_name=MODEL) as s:
        first = ask(s, "What is the sea?")
        assert first[1] == 0
        assert ask(s, "What is a hill?")[1] > 0  # the system prompt came from the index
        entries = len(llm.prefix_index)
        before = pool_metrics(s)
        assert entries > 0 and before["turnkv:prefix_cache_bytes"] > 0 and before["turnkv:stored_conversations"] == 2
        assert before["turnkv:kv_pool_bytes_used"] == llm.pool.bytes_in_use() > 0

        # A request running through the flush keeps its KV and finishes its reply.
        body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "Go on."}], "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        reader, lines, started = stream_in_background(s.url + "/v1/chat/completions", body)
        assert started.wait(30)
        flushed = httpx.post(s.url + "/flush_cache", timeout=30).json()
        reader.join(60)
        assert flushed == {"flushed": 2, "prefix_entries_flushed": entries}
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        assert lines[-1] == "data: [DONE]" and usage["completion_tokens"] == 400
        wait_for(lambda: s.scheduler.num_running == 0, what="the running request to finish")
        assert s.metric("turnkv:stored_conversations") == 1  # the request that ran through the flush

        assert httpx.post(s.url + "/flush_cache", timeout=30).json()["flushed"] == 1
        after = pool_metrics(s)
        assert after == dict.fromkeys(after, 0.0)  # nothing runs: the whole pool is free
        assert llm.pool.bytes_in_use() == 0 and len(llm.prefix_index) == 0
        # The next request finds nothing kept, and replies what it replied the first time.
        assert ask(s, "What is the sea?") == first
