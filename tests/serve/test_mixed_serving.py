"""The server's mixed steps: a prompt that arrives while another request decodes prefills in slices
inside that request's decode steps (turnkv:mixed_steps counts them), and both replies are the
greedy replies each request gets alone."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tests.serve.conftest import running, wait_for
from turnkv.serve import slow_phases

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
def test_a_prompt_arriving_during_decode_gives_the_reply_it_gets_alone(smol, max_step_tokens, monkeypatch, caplog):
    monkeypatch.setattr(slow_phases, "SLOW_PHASE_S", 0.0)  # every phase logs what its step carried
    caplog.set_level(logging.INFO, logger="turnkv.serve")
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
        assert server.metric("turnkv:device_alloc_retries") == 0  # no CUDA allocator on a CPU
        phases = {p: server.metric("turnkv:worker_phase_seconds_count", phase=p)
                  for p in ("admit", "prefill", "decode", "mixed", "finish")}
    assert [out["first"], out["second"]] == alone
    assert phases["mixed"] == mixed_steps and phases["finish"] == 4 and phases["decode"] >= 48
    assert phases["admit"] >= 4 and phases["prefill"] >= 3  # the first slices of the three requests alone
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow mixed phase")]
    if max_step_tokens:
        assert mixed_steps >= 5  # the long prompt's slices of 32 rode along the decode steps
        assert len(slow) == mixed_steps
        assert all("; worker CPU " in m for m in slow)  # a phase says how much of it the worker ran
        assert any("over 1 decode tokens and slices of [32] tokens, then 0 prompt(s) ended" in m for m in slow)
        assert sum(", then 1 prompt(s) ended in " in m for m in slow) == 1  # the long prompt's last slice
    else:
        assert mixed_steps == 0 and not slow


def test_a_short_later_turn_is_not_queued_behind_long_prompts(long_llm):
    """Two long prompts prefill in mixed steps whose budget takes one of their slices; a later turn of
    a kept conversation, a few new tokens, rides in the room the second long slice does not fit, and
    its reply ends before either long prompt's first token."""
    with running(long_llm, served_model_name="m", prefill_chunk=32, max_step_tokens=48) as server:
        client = server.client()

        def ask_at(name: str, messages: list, max_tokens: int, done: dict, **extra):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                   temperature=0, extra_body={"ignore_eos": True, **extra})
            done[name] = (time.monotonic(), reply.usage)

        done: dict = {}
        chat = [{"role": "user", "content": "Hi."}]
        ask_at("turn 1", chat, 2, done)
        reply = server.store.entries[0].conv.last_reply.text
        chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        document = " ".join(["The river runs past the old mill and on to the sea."] * 300)
        threads = [threading.Thread(target=ask_at, args=("stream", [{"role": "user", "content": "Count."}], 400,
                                                         done))]
        threads[0].start()
        wait_for(lambda: server.scheduler.decoding, timeout=60, what="a stream decoding")
        for name in ("long 1", "long 2"):
            threads.append(threading.Thread(target=ask_at, args=(name, [{"role": "user", "content": name + document}],
                                                                  1, done)))
            threads[-1].start()
        wait_for(lambda: len(server.scheduler.prefilling) == 2, timeout=60, what="both long prompts prefilling")
        ask_at("turn 2", chat, 2, done)
        for thread in threads:
            thread.join(120)
    assert done["turn 2"][1].prompt_tokens - done["turn 2"][1].prompt_tokens_details.cached_tokens <= 32
    assert done["turn 2"][0] < min(done["long 1"][0], done["long 2"][0])
