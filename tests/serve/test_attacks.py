"""Requests that attacked the server: recipes naming files, deeply nested bodies, out-of-range seeds,
repeated edits of one reply, prompts no pool can hold. Each gets a precise 400 (or keeps its reuse),
and the server goes on serving."""

from __future__ import annotations

import httpx

from tests.serve.conftest import MODEL, running
from tests.serve.test_errors import CHAT, HELLO, assert_error, post

SYSTEM = {"role": "system", "content": "You are terse."}


def ok(server) -> None:
    r = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_recipe_over_http_reads_no_file(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the server resolves relative paths against its working directory
    (tmp_path / "secret.tsv").write_text("API_KEY=hunter2\n")
    answers = []
    for name in ("secret.tsv", "missing.tsv", "../secret.tsv"):
        r = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                          "recipe": f"prefill=streaming_heads(pattern={name})"})
        error = assert_error(r, 400, "invalid_recipe", "recipe")
        assert "hunter2" not in r.text
        answers.append(error["message"].replace(name, "NAME"))
    # An existing file and a missing one get the same answer: nothing tells which files exist.
    assert answers[0] == answers[1]
    assert "--head-pattern" in answers[0]
    ok(server)
    # Built-in values read nothing and are accepted.
    r = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                      "recipe": "prefill=streaming_heads(pattern=random)"})
    assert r.status_code == 200, r.text


def test_an_operator_names_the_pattern_files_a_recipe_may_use(serve_llm, tmp_path):
    pattern = tmp_path / "heads.tsv"
    pattern.write_text("1\t0\n0\t1\n")  # 2 layers x 2 KV heads; 1 = dense
    with running(serve_llm, served_model_name=MODEL, head_patterns={"mine": str(pattern)}) as s:
        r = post(s, {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                     "recipe": "prefill=streaming_heads(pattern=mine, sink=4, local=8, prefill_local=16)"})
        assert r.status_code == 200, r.text
        error = assert_error(post(s, {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                                      "recipe": "prefill=streaming_heads(pattern=heads.tsv)"}), 400, "invalid_recipe")
        assert "mine" in error["message"]


def test_a_deeply_nested_body_gets_a_400(server):
    for depth in (100, 100_000):
        body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "extra": ' + \
            b"[" * depth + b"]" * depth + b"}"
        error = assert_error(post(server, content=body), 400, "invalid_json")
        assert "deeper than" in error["message"]
    ok(server)


def test_a_seed_beyond_the_samplers_range_gets_a_400(server):
    for seed in (1180591620717411303424, -(1 << 64)):
        assert_error(post(server, {"model": MODEL, "messages": HELLO, "seed": seed, "temperature": 1}), 400,
                     param="seed")
    r = post(server, {"model": MODEL, "messages": HELLO, "seed": (1 << 64) - 1, "temperature": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    ok(server)


def test_repeated_edits_of_one_reply_keep_reusing_the_first_prompt(serve_llm):
    with running(serve_llm, served_model_name=MODEL) as s:
        def cached(messages) -> int:
            r = httpx.post(s.url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 4,
                                               "temperature": 0}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        u1, u2 = {"role": "user", "content": "Which planet is red?"}, {"role": "user", "content": "Why?"}
        assert cached([SYSTEM, u1]) == 0
        first = cached([SYSTEM, u1, {"role": "assistant", "content": "It is Mars, of course."}, u2])
        assert first > 0
        for edit in ("Mars.", "The red one is Mars.", "Mars!"):
            assert cached([SYSTEM, u1, {"role": "assistant", "content": edit}, u2]) == first


def test_a_prompt_no_pool_can_hold_gets_a_400_not_a_retry(chat_model_dir):
    import turnkv

    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="96KiB")  # 192 tokens of one conversation
    with running(small, served_model_name=MODEL) as s:
        big = [{"role": "user", "content": "word " * 300}]  # inside the 512-token context, over the pool
        error = assert_error(post(s, {"model": MODEL, "messages": big, "max_tokens": 2}), 400,
                             "context_length_exceeded")
        assert "KV pool" in error["message"] and "never fit" in error["message"]
        ok(s)


def test_a_request_that_outgrows_the_pool_moves_idle_conversations_out_and_keeps_its_reply(chat_model_dir):
    import turnkv

    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="96KiB", state_cpu_memory="1MiB")
    with running(small, served_model_name=MODEL) as s:
        client = s.client()
        for i in range(2):  # idle conversations holding pages
            client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": f"Story {i}, please."}])
        assert s.store.count("gpu") == 2
        r = client.chat.completions.create(model=MODEL, max_tokens=150, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "A long one."}])
        assert r.usage.completion_tokens == 150 and r.choices[0].finish_reason == "length"
        # The idle conversations went to the CPU tier, not away.
        assert s.metric("turnkv:conversation_evictions_total", reason="offloaded") >= 1
        assert s.metric("turnkv:conversation_evictions_total", reason="dropped") == 0
        # Nothing left to move: a request longer than the pool ends where the pool does, its reply kept.
        s.scheduler.flush()
        r = client.chat.completions.create(model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "Longer still."}])
        assert r.choices[0].finish_reason == "length"
        assert 100 < r.usage.completion_tokens < 400
        assert r.usage.prompt_tokens + r.usage.completion_tokens <= small.pool.sequence_capacity + 1


def test_the_chat_template_and_the_tokenizer_run_off_the_model_worker(serve_llm, server, monkeypatch):
    import threading

    tokenizer, seen = serve_llm.tokenizer, []

    def recorded(fn):
        def call(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tokenizer, "apply_chat_template", recorded(tokenizer.apply_chat_template))
    monkeypatch.setattr(tokenizer, "encode", recorded(tokenizer.encode))
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(2001)]
    r = post(server, {"model": MODEL, "messages": many, "max_tokens": 2})
    assert r.status_code in (200, 400), r.text  # 400: over the context; rendered and encoded all the same
    r = post(server, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 200, r.text
    assert seen and "turnkv-worker" not in seen
    assert any(name.startswith("turnkv-encode") for name in seen)


def test_a_restarted_server_under_a_compressing_recipe_gives_the_uninterrupted_reply(chat_model_dir, tmp_path):
    import turnkv

    recipe = "ada-snapkv budget=40"
    turns = ["Tell me a long story about the sea and its ships.", "And the mountains behind the harbour?",
             "Which is older?"]

    def run(s, messages, turn):
        messages.append({"role": "user", "content": turn})
        r = post(s, {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                     "recipe": recipe})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def llm(disk=None):
        return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB",
                          state_disk_dir=None if disk is None else str(disk))

    with running(llm(), served_model_name=MODEL) as s:
        want = [SYSTEM]
        cached = [run(s, want, turn) for turn in turns]
    got = [SYSTEM]
    with running(llm(tmp_path), served_model_name=MODEL) as s:
        for turn in turns[:2]:
            run(s, got, turn)
    with running(llm(tmp_path), served_model_name=MODEL) as s:
        assert run(s, got, turns[2]) == cached[2] > 0
    assert got == want
