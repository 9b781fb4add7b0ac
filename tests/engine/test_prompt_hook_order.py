"""A turn's after-prompt hook (a recipe's compression of the history) runs once its first token is
sampled and on its way, and before its first decode step: in conv.send / conv.stream and in the
server. The tokens, the kept KV and the replies are those of the hook run inside the prefill."""

from __future__ import annotations

import httpx
import pytest

import turnkv
from turnkv.engine import turn as turn_module
from turnkv.engine.generation import Generation
from turnkv.methods.recipe import Recipe

RECIPE = "snapkv budget=48 schedule=prompt"  # compresses after every prompt, the first included
DOCUMENT = " ".join(f"Line {i} says the river bends near stone {i * 7}." for i in range(20))
QUESTIONS = ["What bends?", "Which stone is last?", "Say it again."]


@pytest.fixture
def events(monkeypatch):
    """The order of first tokens sampled, after-prompt hooks and decode forwards, across the engine."""
    out = []
    hook, accept = Recipe.after_prompt, Generation.accept

    def spy_hook(self, kv, *args):
        out.append("hook")
        return hook(self, kv, *args)

    def spy_accept(self, token, *args, **kwargs):
        if not self.token_ids:
            out.append("first token")
        return accept(self, token, *args, **kwargs)

    monkeypatch.setattr(Recipe, "after_prompt", spy_hook)
    monkeypatch.setattr(Generation, "accept", spy_accept)
    return out


def _llm(chat_model_dir, events):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", recipe=RECIPE)
    decode = llm.runner.decode

    def spy_decode(*args, **kwargs):
        events.append("decode")
        return decode(*args, **kwargs)

    llm.runner.decode = spy_decode
    return llm


def _turns(llm, max_new_tokens=5, stream=False):
    """Per turn: (reply text, KV lengths [L, H] after it), through send() or stream()."""
    conv = llm.conversation(system="Answer briefly.")
    out = []
    for text in [DOCUMENT + " " + QUESTIONS[0], *QUESTIONS[1:]]:
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        reply = "".join(conv.stream(text, **sampling)) if stream else conv.send(text, **sampling).text
        out.append((reply, conv.kv.lengths.copy()))
    return out


def test_the_first_token_comes_before_the_compression_and_the_compression_before_decoding(chat_model_dir, events):
    llm = _llm(chat_model_dir, events)
    turns = _turns(llm)
    # Every turn: its first token, then the hook, then its decode steps (4 more tokens).
    assert events == ["first token", "hook"] + ["decode"] * 4 + (["first token", "hook"] + ["decode"] * 4) * 2
    assert turns[0][1].max() <= 48 + 5  # the document was compressed to the budget (plus the reply)


def test_deferring_the_hook_changes_no_token_and_no_kept_kv(chat_model_dir, events, monkeypatch):
    deferred = _turns(_llm(chat_model_dir, events))
    streamed = _turns(_llm(chat_model_dir, events), stream=True)
    monkeypatch.setattr(turn_module.TurnRun, "_prompt_in",  # the hook inside the prefill, as before
                        lambda self, defer: (setattr(self, "prompt_hook_due", True), self.settle()))
    inline = _turns(_llm(chat_model_dir, events))
    assert [text for text, _ in deferred] == [text for text, _ in inline] == [text for text, _ in streamed]
    for (_, a), (_, b), (_, c) in zip(deferred, inline, streamed):
        assert (a == b).all() and (a == c).all()


def test_a_reply_of_one_token_still_compresses_before_the_turn_ends(chat_model_dir, events):
    llm = _llm(chat_model_dir, events)
    turns = _turns(llm, max_new_tokens=1)
    assert "decode" not in events and events.count("hook") == 3
    assert events[:2] == ["first token", "hook"]
    assert turns[0][1].max() <= 48 + 1


def test_the_server_sends_its_first_event_before_the_compression(chat_model_dir, events, monkeypatch):
    from tests.serve.conftest import running
    from turnkv.serve import app as app_module

    push = app_module.Stream.push

    def spy_push(self, kind, payload):
        if kind == "start":
            events.append("start event")
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
    assert events[:3] == ["first token", "start event", "hook"]
