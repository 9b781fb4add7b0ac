"""The server sends a request's first event once its first token is sampled, before the recipe's
after-prompt hook (a compression of the history) runs (tests/engine/test_prompt_hook_order.py: the
same in the library)."""

from __future__ import annotations

import httpx

import turnkv
from tests.engine.test_prompt_hook_order import DOCUMENT, QUESTIONS, RECIPE
from tests.serve.conftest import running


def test_the_server_sends_its_first_event_before_the_compression(chat_model_dir, prompt_hook_events, monkeypatch):
    from turnkv.serve import app as app_module

    push = app_module.Stream.push

    def spy_push(self, kind, payload):
        if kind == "start":
            prompt_hook_events.append("start event")
        return push(self, kind, payload)

    monkeypatch.setattr(app_module.Stream, "push", spy_push)
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    with running(llm, served_model_name="tiny", max_step_tokens=0) as server:
        messages = [{"role": "user", "content": DOCUMENT + " " + QUESTIONS[0]}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True, "recipe": RECIPE}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert prompt_hook_events[:3] == ["first token", "start event", "hook"]
