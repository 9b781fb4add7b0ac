"""turnkv.serve.ray: the routing key and rendezvous hashing, then the Ray Serve application on a local
Ray instance (CPU, two engine replicas over the tiny model): every turn of a conversation lands on
one replica, so later turns reuse its KV; streaming goes through the router unchanged."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from tests.serve.conftest import MODEL, local_ray_serve  # noqa: E402
from turnkv.serve.ray import REPLICA_HEADER, build_app, rendezvous, routing_key  # noqa: E402


def test_routing_key_follows_the_session_or_the_opening_messages():
    def body(messages):
        return json.dumps({"model": MODEL, "messages": messages}).encode()

    system, first = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}
    later = [system, first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    assert routing_key(None, body([system, first])) == routing_key(None, body(later))  # every turn, one key
    other = {"role": "user", "content": "Hey"}
    assert routing_key(None, body([system, other])) != routing_key(None, body([system, first]))
    assert routing_key("alice", body([system, first])) == routing_key("alice", b"") == "session:alice"
    assert routing_key(None, b"") is None and routing_key(None, b"not json") is None  # any replica answers
    prompt = json.dumps({"prompt": "Once upon a time"}).encode()
    assert routing_key(None, prompt).startswith("prompt:")


def test_rendezvous_spreads_keys_and_moves_only_those_of_a_changed_replica():
    replicas = ["r1", "r2", "r3"]
    keys = [f"session:{i}" for i in range(300)]
    owner = {k: rendezvous(k, replicas) for k in keys}
    assert all(list(owner.values()).count(r) > 60 for r in replicas)
    after = {k: rendezvous(k, ["r1", "r2", "r3", "r4"]) for k in keys}
    assert all(after[k] in (owner[k], "r4") for k in keys)  # a new replica only takes keys over
    gone = {k: rendezvous(k, ["r1", "r3"]) for k in keys}
    assert all(gone[k] == owner[k] for k in keys if owner[k] != "r2")  # only r2's keys move


@pytest.fixture(scope="module")
def ray_app(chat_model_dir):
    with local_ray_serve(lambda: build_app(
            str(chat_model_dir), num_replicas=2,
            llm_options={"device": "cpu", "kv_memory": "16MiB", "state_cpu_memory": "4MiB"},
            config={"served_model_name": MODEL},
            engine_actor_options={"num_cpus": 0}, router_actor_options={"num_cpus": 0})) as url:
        yield url


def test_each_conversation_stays_on_one_replica_and_reuses_its_kv(ray_app):
    import httpx
    import openai

    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="unused", max_retries=0)
    served_by = {}
    for name in ["alice", "bob", "carol", "dave", None, "erin"]:
        headers = {"X-Session-Id": name} if name else {}
        messages = [{"role": "system", "content": f"You talk to {name or 'anyone'}."}]
        for turn in ("Hello.", "Tell me more.", "And then?"):
            messages.append({"role": "user", "content": turn})
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_headers=headers or None)
            r = raw.parse()
            served_by.setdefault(name, set()).add(raw.headers[REPLICA_HEADER])
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            if turn != "Hello.":  # only that replica holds the history
                assert r.usage.prompt_tokens_details.cached_tokens > 0, (name, turn)
    assert all(len(replicas) == 1 for replicas in served_by.values())
    # Keys spread over the replicas: 16 sessions all on one replica would happen once in 2**15 runs.
    for i in range(10):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_headers={"X-Session-Id": f"s{i}"})
        served_by[f"s{i}"] = {raw.headers[REPLICA_HEADER]}
    assert len(set().union(*served_by.values())) == 2

    # Streaming passes through the router as it comes; the reply is the non-streamed one.
    messages = [{"role": "user", "content": "Count to three."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", ray_app + "/v1/chat/completions", json=body, headers={"X-Session-Id": "streamer"},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in lines[:-1])
    assert text == whole.choices[0].message.content
    assert httpx.get(ray_app + "/health").json() == {"status": "ok"}
    # Errors come back as the engine gives them.
    bad = httpx.post(ray_app + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
