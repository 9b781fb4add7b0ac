"""The server's mixed steps: a prompt that arrives while another request decodes prefills in slices
inside that request's decode steps (turnkv:mixed_steps counts them), and both replies are the
greedy replies each request gets alone."""

from __future__ import annotations

import threading

import pytest

from tests.serve.conftest import running, wait_for

pytestmark = pytest.mark.slow

LONG = " ".join(["Paris is the capital of France, a large city with many museums."] * 30)


@pytest.fixture(scope="module")
def smol(embedded_model):
    import turnkv

    return turnkv.LLM(embedded_model, device="cpu", kv_memory="128MiB")


def ask(server, text: str, max_tokens: int) -> str:
    reply = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})
    return reply.choices[0].message.content


@pytest.mark.parametrize("max_step_tokens", [96, 0])
def test_a_prompt_arriving_during_decode_gives_the_reply_it_gets_alone(smol, max_step_tokens):
    first, second = "Count from one to fifty in words.", LONG + " What is the capital of France?"
    with running(smol, served_model_name="m", reuse=False, prefill_chunk=32,
                 max_step_tokens=max_step_tokens) as server:
        alone = [ask(server, first, 48), ask(server, second, 8)]
        assert server.metric("turnkv:mixed_steps_total") == 0
        out = {}
        decoding = threading.Thread(target=lambda: out.setdefault("first", ask(server, first, 48)))
        decoding.start()
        wait_for(lambda: server.metric("vllm:generation_tokens_total") > 0 or server.scheduler.decoding,
                 timeout=60, what="the first request decoding")
        out["second"] = ask(server, second, 8)
        decoding.join(120)
        mixed_steps = server.metric("turnkv:mixed_steps_total")
    assert [out["first"], out["second"]] == alone
    if max_step_tokens:
        assert mixed_steps >= 5  # the long prompt's slices of 32 rode along the decode steps
    else:
        assert mixed_steps == 0
