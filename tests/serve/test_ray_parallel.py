"""A Ray Serve replica as a tensor-parallel group: one replica at tensor_parallel=2 on CPU (gloo), its
second rank a process the replica starts. Its replies equal one engine's at N=1, turn by turn, and a
later turn reuses the replica's KV. On a GPU, the replica asks Ray for N GPUs."""

from __future__ import annotations


import pytest

pytest.importorskip("ray.serve")

from tests.serve.conftest import MODEL, local_ray_serve  # noqa: E402
from turnkv.serve.ray import build_app, replica_resources  # noqa: E402


def test_a_tensor_parallel_replica_asks_for_its_gpus_unless_told():
    assert replica_resources({"tensor_parallel": 4}, {}) == {"num_gpus": 4}
    assert replica_resources({"tensor_parallel": 4, "device": "cuda"}, {"num_cpus": 2}) == {"num_cpus": 2, "num_gpus": 4}
    assert replica_resources({"tensor_parallel": 4}, {"num_gpus": 2}) == {"num_gpus": 2}  # the caller's word
    assert replica_resources({"tensor_parallel": 2, "device": "cpu"}, {}) == {}
    assert replica_resources({}, {"num_cpus": 1}) == {"num_cpus": 1}


@pytest.fixture(scope="module")
def ray_tp_app(chat_model_dir):
    with local_ray_serve(lambda: build_app(
            str(chat_model_dir), num_replicas=1,
            llm_options={"device": "cpu", "kv_memory": "16MiB", "tensor_parallel": 2},
            config={"served_model_name": MODEL},
            engine_actor_options={"num_cpus": 0}, router_actor_options={"num_cpus": 0})) as url:
        yield url


def test_a_tensor_parallel_replica_replies_as_one_engine_does(ray_tp_app, chat_model_dir):
    """The same three turns against the replica (N=2) and against one engine's server at N=1."""
    import openai

    import turnkv
    from tests.serve.conftest import running

    single = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB")
    with running(single, served_model_name=MODEL) as one:
        replies = {}
        for url in (ray_tp_app, one.url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            messages = [{"role": "system", "content": "You are terse."}]
            for turn in ("Hello there.", "Tell me more.", "And then?"):
                messages.append({"role": "user", "content": turn})
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                   extra_headers={"X-Session-Id": "tp"})
                if turn != "Hello there.":  # the replica kept the history: a later turn reuses it
                    assert r.usage.prompt_tokens_details.cached_tokens > 0, (url, turn)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
            replies[url] = [m["content"] for m in messages if m["role"] == "assistant"]
        assert _gauge(one.url, "turnkv:tensor_parallel_size") == 1.0
    assert _gauge(ray_tp_app, "turnkv:tensor_parallel_size") == 2.0  # the replica is one group of 2 ranks
    assert replies[ray_tp_app] == replies[one.url]
    assert all(replies[one.url])


def _gauge(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", headers={"X-Session-Id": "tp"}).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
