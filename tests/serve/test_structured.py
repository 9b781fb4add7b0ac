"""Structured output: response_format json_schema (strict) and json_object through the official openai
client, the grammar's mask applied to its own request's row inside the batched decode step."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest

from tests.serve.conftest import MODEL, running
from tests.serve.test_errors import HELLO, assert_error, post

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["kind", "brave", "odd"]}, "maxItems": 3},
    "member": {"type": "boolean"}},
    "required": ["name", "age", "tags", "member"], "additionalProperties": False}


def test_json_schema_replies_parse_and_match_the_schema_every_time(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Person {seed}?"}],
                                           response_format=fmt, temperature=1.0, seed=seed, max_tokens=120)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # Streamed, the pieces add up to the same kind of object.
    chunks = client.chat.completions.create(model=MODEL, messages=HELLO, response_format=fmt, stream=True,
                                            temperature=0, max_tokens=120)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)


def test_json_object_replies_are_json_objects(server):
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, response_format={"type": "json_object"},
                                           temperature=0.7, seed=seed, max_tokens=300)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # cut by max_tokens: still the start of one object
            assert r.choices[0].message.content.startswith("{")


def test_the_mask_touches_only_its_own_request_in_a_shared_batch(long_llm):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with running(long_llm, served_model_name=MODEL) as s:
        alone = post(s, body).json()["choices"][0]["message"]["content"]
        out = {}

        def send(name, extra):
            out[name] = httpx.post(s.url + "/v1/chat/completions", json={**body, **extra}, timeout=60).json()

        threads = [threading.Thread(target=send, args=("structured", {"response_format": fmt, "ignore_eos": False})),
                   threading.Thread(target=send, args=("plain", {}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shared = s.metric("turnkv:decode_batch_size_bucket", le="2.0") - s.metric("turnkv:decode_batch_size_bucket",
                                                                                   le="1.0")
        assert shared > 0  # the two requests decoded in the same steps
    assert out["plain"]["choices"][0]["message"]["content"] == alone
    jsonschema.validate(json.loads(out["structured"]["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
    {"type": "xml"},
])
def test_a_bad_response_format_gets_a_400(server, response_format):
    assert_error(post(server, {"model": MODEL, "messages": HELLO, "response_format": response_format}), 400,
                 param="response_format")
