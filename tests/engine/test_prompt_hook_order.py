"""A turn's after-prompt hook (a recipe's compression of the history) runs once its first token is
sampled and on its way, and before its first decode step, in conv.send / conv.stream (the server:
tests/serve/test_first_token_order.py). The tokens and the kept KV are those of the hook run inside
the prefill."""

from __future__ import annotations

import turnkv
from turnkv.engine import turn as turn_module

RECIPE = "snapkv budget=48 schedule=prompt"  # compresses after every prompt, the first included
DOCUMENT = " ".join(f"Line {i} says the river bends near stone {i * 7}." for i in range(20))
QUESTIONS = ["What bends?", "Which stone is last?", "Say it again."]


def _llm(chat_model_dir, prompt_hook_events):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", recipe=RECIPE)
    decode = llm.runner.decode

    def spy_decode(*args, **kwargs):
        prompt_hook_events.append("decode")
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


def test_the_first_token_comes_before_the_compression_and_the_compression_before_decoding(chat_model_dir,
                                                                                        prompt_hook_events):
    llm = _llm(chat_model_dir, prompt_hook_events)
    turns = _turns(llm)
    # Every turn: its first token, then the hook, then its decode steps (4 more tokens).
    assert prompt_hook_events == (["first token", "hook"] + ["decode"] * 4) * 3
    assert turns[0][1].max() <= 48 + 5  # the document was compressed to the budget (plus the reply)


def test_deferring_the_hook_changes_no_token_and_no_kept_kv(chat_model_dir, prompt_hook_events, monkeypatch):
    deferred = _turns(_llm(chat_model_dir, prompt_hook_events))
    streamed = _turns(_llm(chat_model_dir, prompt_hook_events), stream=True)
    monkeypatch.setattr(turn_module.TurnRun, "_prompt_in",  # the hook inside the prefill, as before
                        lambda self, defer: (setattr(self, "prompt_hook_due", True), self.settle()))
    inline = _turns(_llm(chat_model_dir, prompt_hook_events))
    assert [text for text, _ in deferred] == [text for text, _ in inline] == [text for text, _ in streamed]
    for (_, a), (_, b), (_, c) in zip(deferred, inline, streamed):
        assert (a == b).all() and (a == c).all()


def test_a_reply_of_one_token_still_compresses_before_the_turn_ends(chat_model_dir, prompt_hook_events):
    llm = _llm(chat_model_dir, prompt_hook_events)
    turns = _turns(llm, max_new_tokens=1)
    assert "decode" not in prompt_hook_events and prompt_hook_events.count("hook") == 3
    assert prompt_hook_events[:2] == ["first token", "hook"]
    assert turns[0][1].max() <= 48 + 1
