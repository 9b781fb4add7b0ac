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


# A 400 whose fault is the body itself, not one of its fields: the only ones whose param is null.
BODY_FAULTS = ("not valid JSON", "must be a JSON object", "deeper than", "not valid UTF-8")


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI error object of `r`, checked: status, code and param when given. Every 400 names
    the field at fault in `param`, but one whose fault is the body itself (BODY_FAULTS)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error", "rate_limit_error", "server_error")
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    if status == 400:
        body_fault = any(fault in error["message"] for fault in BODY_FAULTS)
        assert (error["param"] is None) == body_fault, error
    return error


COMPLETIONS = "/v1/completions"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NESTED = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 80 + b"]" * 80 + b"}"


def chat(**fields) -> dict:
    return dict(body={"model": MODEL, "messages": HELLO, **fields})


def completion(**fields) -> dict:
    return dict(body={"model": MODEL, "prompt": "Hello.", **fields}, path=COMPLETIONS)


# (case, request, status, code, param): every bad request the server answers with a 400 or 404 names
# its field in `param`; only a body that is not a JSON object in UTF-8 has none.
BAD_REQUESTS = [
    ("malformed JSON", dict(content=b'{"model": "tiny", "messages": ['), 400, "invalid_json", None),
    ("not an object", dict(content=b'[1, 2]'), 400, "invalid_json", None),
    ("nested too deep", dict(content=NESTED), 400, "invalid_json", None),
    ("invalid UTF-8", dict(content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400,
     "invalid_utf8", None),
    ("a lone surrogate", dict(content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'), 400,
     "invalid_utf8", "messages"),
    ("a lone surrogate in the prompt", dict(content=b'{"model": "tiny", "prompt": "a\\udfffb"}', path=COMPLETIONS),
     400, "invalid_utf8", "prompt"),
    ("missing messages", dict(body={"model": MODEL}), 400, None, "messages"),
    ("messages of the wrong type", dict(body={"model": MODEL, "messages": "Hello."}), 400, None, "messages"),
    ("no messages", dict(body={"model": MODEL, "messages": []}), 400, None, "messages"),
    ("an unknown role", dict(body={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400, None,
     "messages"),
    ("a tool message without tool_call_id", dict(body={"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}),
     400, None, "messages"),
    ("temperature as text", chat(temperature="hot"), 400, None, "temperature"),
    ("temperature out of range", chat(temperature=2.5), 400, None, "temperature"),
    ("max_tokens as text", chat(max_tokens="10"), 400, None, "max_tokens"),
    ("top_p out of range", chat(top_p=0), 400, None, "top_p"),
    ("negative top_k", chat(top_k=-1), 400, None, "top_k"),
    ("negative max_tokens", chat(max_tokens=-5), 400, None, "max_tokens"),
    ("absurd max_tokens", chat(max_tokens=10**12), 400, None, "max_tokens"),
    ("max_completion_tokens 0", chat(max_completion_tokens=0), 400, None, "max_completion_tokens"),
    ("max_completion_tokens past the context", chat(max_completion_tokens=500), 400, "context_length_exceeded",
     "max_completion_tokens"),
    ("max_tokens past the context", chat(max_tokens=500), 400, "context_length_exceeded", "max_tokens"),
    ("n > 1", chat(n=2), 400, None, "n"),
    ("a seed out of range", chat(seed=1 << 70), 400, None, "seed"),
    ("an empty stop string", chat(stop=["x", ""]), 400, None, "stop"),
    ("frequency_penalty out of range", chat(frequency_penalty=3), 400, None, "frequency_penalty"),
    ("presence_penalty out of range", chat(presence_penalty=-2.5), 400, None, "presence_penalty"),
    ("a logit_bias key that is no id", chat(logit_bias={"abc": 1}), 400, None, "logit_bias"),
    ("a logit_bias value out of range", chat(logit_bias={"5": 101}), 400, None, "logit_bias"),
    ("a logit_bias id past the vocabulary", chat(logit_bias={"99999999": 1}), 400, None, "logit_bias"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), 400, None, "top_logprobs"),
    ("top_logprobs over 20", chat(logprobs=True, top_logprobs=21), 400, None, "top_logprobs"),
    ("an unsupported field", chat(audio={"voice": "alloy"}), 400, "unsupported_field", "audio"),
    ("stream_options of the wrong type", chat(stream=True, stream_options={"include_usage": "yes"}), 400, None,
     "stream_options"),
    ("an unknown model", dict(body={"model": "gpt-17", "messages": HELLO}), 404, "model_not_found", "model"),
    ("an unknown recipe", chat(recipe="zipkv"), 400, "invalid_recipe", "recipe"),
    ("a recipe file path", chat(recipe="/etc/passwd.yaml"), 400, "invalid_recipe", "recipe"),
    ("a recipe whose kv_dtype the pool does not hold", chat(recipe="full kv_dtype=int8"), 400, "invalid_recipe",
     "recipe"),
    ("a prompt over the context", dict(body={"model": MODEL, "messages": [{"role": "user", "content": "word " * 700}]}),
     400, "context_length_exceeded", "messages"),
    ("tool_choice naming no tool", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, None, "tool_choice"),
    ("duplicate tool names", chat(tools=[TOOL, TOOL]), 400, None, "tools"),
    ("a bad tool name", chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, None, "tools"),
    ("tool_choice required without tools", chat(tool_choice="required"), 400, None, "tool_choice"),
    ("response_format with tools a reply may call", chat(tools=[TOOL], tool_choice="auto",
                                                               response_format={"type": "json_object"}), 400,
     None, "response_format"),
    ("response_format json_schema without a schema", chat(response_format={"type": "json_schema"}), 400, None,
     "response_format"),
    ("an unknown response_format", chat(response_format={"type": "xml"}), 400, None, "response_format"),
    ("an empty prompt", dict(body={"model": MODEL, "prompt": ""}, path=COMPLETIONS), 400, None, "prompt"),
    ("two prompts", dict(body={"model": MODEL, "prompt": ["a", "b"]}, path=COMPLETIONS), 400, None, "prompt"),
    ("a negative prompt id", dict(body={"model": MODEL, "prompt": [5, -1]}, path=COMPLETIONS), 400, None, "prompt"),
    ("a prompt id past the vocabulary", dict(body={"model": MODEL, "prompt": [10**9]}, path=COMPLETIONS), 400, None,
     "prompt"),
    ("an id prompt over the context", dict(body={"model": MODEL, "prompt": [5] * 600}, path=COMPLETIONS), 400,
     "context_length_exceeded", "prompt"),
    ("a text prompt over the context", completion(prompt="word " * 700), 400, "context_length_exceeded", "prompt"),
    ("completion max_tokens past the context", completion(prompt="word " * 20, max_tokens=500), 400,
     "context_length_exceeded", "max_tokens"),
    ("completion max_tokens 0", completion(max_tokens=0), 400, None, "max_tokens"),
    ("completion logprobs over 20", completion(logprobs=21), 400, None, "logprobs"),
    ("completion echo", completion(echo=True), 400, "unsupported_field", "echo"),
    ("a bad session id", dict(body={"model": MODEL, "messages": HELLO}, headers={"x-session-id": "a\tb"}), 400, None,
     "x-session-id"),
]


@pytest.mark.parametrize("case,request_kwargs,status,code,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_naming_its_field_and_the_server_goes_on(server, case, request_kwargs, status,
                                                                               code, param):
    error = assert_error(post(server, **request_kwargs), status, code)
    assert error["param"] == param
    if param == "max_completion_tokens":
        assert "max_tokens" not in error["message"]
    ok = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_streamed_request_gets_the_same_errors_before_its_stream_starts(server):
    r = post(server, {"model": MODEL, "messages": HELLO, "max_completion_tokens": 500, "stream": True})
    assert_error(r, 400, "context_length_exceeded", "max_completion_tokens")
    r = post(server, {"model": MODEL, "prompt": [5] * 600, "stream": True}, path=COMPLETIONS)
    assert_error(r, 400, "context_length_exceeded", "prompt")


def test_unknown_routes_get_a_404(server):
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
