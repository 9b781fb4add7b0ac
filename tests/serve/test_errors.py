"""Bad input gets an OpenAI-style error with the right status and the server keeps serving; the API
key; 429 with Retry-After when the queue is full; a client that leaves frees its slot."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.serve.conftest import MODEL, running, wait_for

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello."}]


def post(server, body=None, content: bytes | None = None, path: str = CHAT, **kwargs) -> httpx.Response:
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=30, **kwargs)
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error", "rate_limit_error", "server_error")
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


BAD_BODIES = [
    ("malformed JSON", dict(content=b'{"model": "tiny", "messages": ['), 400, "invalid_json", None),
    ("not an object", dict(content=b'[1, 2]'), 400, "invalid_json", None),
    ("missing messages", dict(body={"model": MODEL}), 400, None, "messages"),
    ("messages of the wrong type", dict(body={"model": MODEL, "messages": "Hello."}), 400, None, "messages"),
    ("an unknown role", dict(body={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400, None, None),
    ("temperature as text", dict(body={"model": MODEL, "messages": HELLO, "temperature": "hot"}), 400, None, "temperature"),
    ("max_tokens as text", dict(body={"model": MODEL, "messages": HELLO, "max_tokens": "10"}), 400, None, "max_tokens"),
    ("top_p out of range", dict(body={"model": MODEL, "messages": HELLO, "top_p": 0}), 400, None, "top_p"),
    ("negative max_tokens", dict(body={"model": MODEL, "messages": HELLO, "max_tokens": -5}), 400, None, None),
    ("absurd max_tokens", dict(body={"model": MODEL, "messages": HELLO, "max_tokens": 10**12}), 400, None, None),
    ("n > 1", dict(body={"model": MODEL, "messages": HELLO, "n": 2}), 400, None, "n"),
    ("an unknown model", dict(body={"model": "gpt-17", "messages": HELLO}), 404, "model_not_found", "model"),
    ("an unknown recipe", dict(body={"model": MODEL, "messages": HELLO, "recipe": "zipkv"}), 400, "invalid_recipe", "recipe"),
    ("a recipe file path", dict(body={"model": MODEL, "messages": HELLO, "recipe": "/etc/passwd.yaml"}), 400,
     "invalid_recipe", "recipe"),
    ("invalid UTF-8", dict(content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400,
     "invalid_utf8", None),
    ("a lone surrogate", dict(content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'), 400,
     "invalid_utf8", None),
    ("a prompt over the context", dict(body={"model": MODEL, "messages": [{"role": "user", "content": "word " * 700}]}),
     400, "context_length_exceeded", None),
    ("max_tokens past the context", dict(body={"model": MODEL, "messages": HELLO, "max_tokens": 500}), 400,
     "context_length_exceeded", None),
]


@pytest.mark.parametrize("case,request_kwargs,status,code,param", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, case, request_kwargs, status, code, param):
    assert_error(post(server, **request_kwargs), status, code, param)
    ok = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_bad_completions_and_routes(server):
    assert_error(post(server, {"model": MODEL, "prompt": ""}, path="/v1/completions"), 400, None, "prompt")
    assert_error(post(server, {"model": MODEL, "prompt": [10**9]}, path="/v1/completions"), 400)
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert server.metric("vllm:num_requests_running") == 0


def test_a_huge_body_is_refused_before_it_is_read(serve_llm):
    with running(serve_llm, served_model_name=MODEL, max_body_bytes=64 << 10) as small:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (256 << 10)}]}
        assert_error(post(small, big), 413, "body_too_large")
        chunks = (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"y" * 4096 for _ in range(64))
        assert_error(httpx.post(small.url + CHAT, content=chunks, timeout=30), 413, "body_too_large")  # chunked
        assert post(small, {"model": MODEL, "messages": HELLO, "max_tokens": 2}).status_code == 200


def test_api_key_is_checked_on_every_v1_route(serve_llm, monkeypatch):
    with running(serve_llm, served_model_name=MODEL, api_key="sekret") as locked:
        for method, path in [("GET", "/v1/models"), ("POST", CHAT), ("POST", "/v1/completions")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                assert_error(httpx.request(method, locked.url + path, headers=headers, json={}), 401, "invalid_api_key")
        reply = locked.client(api_key="sekret").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert reply.choices[0].message.content is not None
        assert httpx.get(locked.url + "/health").status_code == 200  # probes and scrapers need no key
        assert httpx.get(locked.url + "/metrics").status_code == 200


def long_request(server, **extra) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 6000, "ignore_eos": True, **extra}


def test_full_queue_gets_429_and_a_disconnect_frees_the_slot(long_llm):
    with running(long_llm, served_model_name=MODEL, max_running=1, max_waiting=1) as s:
        baseline = long_llm.pool.bytes_in_use()
        with httpx.stream("POST", s.url + CHAT, json=long_request(s, stream=True), timeout=60) as running_stream:
            lines = running_stream.iter_lines()
            assert next(lines).startswith("data: ")  # admitted and decoding
            queued = {}
            waiter = threading.Thread(target=lambda: queued.setdefault(
                "r", post(s, {"model": MODEL, "messages": HELLO, "max_tokens": 3})))
            waiter.start()
            wait_for(lambda: s.scheduler.num_waiting == 1, what="the second request to queue")
            refused = post(s, {"model": MODEL, "messages": HELLO, "max_tokens": 3})
            assert_error(refused, 429, "queue_full")
            assert refused.headers["Retry-After"] == "1"
            assert s.scheduler.num_running == 1
        # The stream was closed mid-generation: its slot goes to the queued request.
        waiter.join(30)
        assert queued["r"].status_code == 200
        assert s.metric("turnkv:requests_failed_total", reason="disconnected") == 1
        assert s.metric("turnkv:requests_rejected_total", reason="queue_full") == 1
        wait_for(lambda: s.scheduler.num_running == 0)
        # The abandoned request's KV is gone; what is left is the finished request's kept conversation.
        assert long_llm.pool.bytes_in_use() - baseline == s.store.kv_bytes("gpu")


def test_a_non_streaming_client_that_leaves_frees_its_slot(long_llm):
    with running(long_llm, served_model_name=MODEL, max_running=1, max_waiting=0) as s:
        baseline = long_llm.pool.bytes_in_use()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + CHAT, json=long_request(s), timeout=httpx.Timeout(30, read=0.5))
        wait_for(lambda: s.scheduler.num_running == 0, what="the abandoned request to be dropped")
        assert long_llm.pool.bytes_in_use() == baseline
        assert post(s, {"model": MODEL, "messages": HELLO, "max_tokens": 2}).status_code == 200
