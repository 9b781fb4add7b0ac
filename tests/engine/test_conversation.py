"""Multi-turn conversations: each turn prefills only its new tokens, and the result is exactly what a
full recompute of the history gives. Bad input fails clearly and loses nothing."""

from __future__ import annotations

import pytest
import torch

import turnkv
from turnkv.engine import chat_template
from turnkv.errors import ContextLengthError, InvalidRequestError, KVCacheFullError
from turnkv.kv.sequence import SequenceKV

MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?", "Summarise both."]


def greedy_from_scratch(llm, prompt: list[int], n: int) -> list[int]:
    """Recompute: prefill the whole history in a fresh sequence, then greedy-decode n tokens."""
    seq = SequenceKV(llm.pool)
    try:
        out = [int(llm.runner.prefill(seq, prompt).argmax())]
        while len(out) < n:
            out.append(int(llm.runner.decode([seq], torch.tensor([out[-1]]))[0].argmax()))
        return out
    finally:
        seq.free()


def test_turns_equal_full_recompute_turn_by_turn(chat_llm):
    conv = chat_llm.conversation(system="You are terse, and no other test's conversation says so.")
    for i, message in enumerate(MESSAGES):
        before = len(conv.tokens)
        reply = conv.send(message, max_new_tokens=12)
        turn = conv.turns[-1]
        # Only the new tokens were prefilled; everything before them came from the kept KV.
        assert reply.cached_tokens == (0 if i == 0 else before - 1)  # the last reply token was never fed
        assert reply.prompt_tokens == turn.prompt_end - reply.cached_tokens
        assert conv.tokens[turn.prompt_end :] == reply.token_ids
        assert greedy_from_scratch(chat_llm, conv.tokens[: turn.prompt_end], len(reply.token_ids)) == reply.token_ids
        # The history renders exactly as the chat template renders the messages so far.
        rendered = chat_llm.tokenizer.apply_chat_template(conv.messages, tokenize=False)
        assert rendered.startswith(chat_llm.tokenizer.decode(conv.tokens[: turn.prompt_end]))
    assert conv.kv.next_position == len(conv.tokens) - 1
    conv.close()


def test_a_conversation_continues_a_given_history(chat_llm):
    """history=: earlier turns the first send prefills with its message, exactly as the chat template
    renders them; reset goes back to that history; malformed histories are refused."""
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]
    conv = chat_llm.conversation(system="You are terse.", history=history)
    reply = conv.send("Another one?", max_new_tokens=8)
    asked = [{"role": "system", "content": "You are terse."}, *history, {"role": "user", "content": "Another one?"}]
    prompt = chat_llm.tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    ids = chat_llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert reply.cached_tokens == 0 and reply.prompt_tokens == len(ids) and conv.tokens[: len(ids)] == ids
    assert greedy_from_scratch(chat_llm, ids, len(reply.token_ids)) == reply.token_ids
    assert conv.messages == [*asked, {"role": "assistant", "content": reply.text}]
    conv.reset()
    assert conv.messages == asked[:-1] and conv.tokens == []
    assert conv.send("Another one?", max_new_tokens=8).token_ids == reply.token_ids
    conv.close()
    for bad in ("Teal.", [{"role": "system", "content": "x"}], [{"role": "user"}],
                [{"role": "user", "content": "x", "name": "n"}], [["user", "x"]]):
        with pytest.raises(InvalidRequestError, match="history"):
            chat_llm.conversation(history=bad)


def test_turn_stats_and_kv_accounting(chat_llm):
    conv = chat_llm.conversation()
    r1 = conv.send("One.", max_new_tokens=5)
    r2 = conv.send("Two.", max_new_tokens=5)
    c = chat_llm.config
    per_page = chat_llm.pool.page_bytes
    assert r2.kv_bytes == conv.kv.bytes() == int(conv.kv.num_pages.sum()) * per_page
    assert r2.kv_tokens == conv.kv.next_position * c.num_layers * c.num_kv_heads
    assert r2.kv_bytes > r1.kv_bytes
    assert r1.ttft_s > 0 and r2.completion_tokens == 5 and r2.finish_reason == "length"
    conv.close()
    assert conv.kv.bytes() == 0


def test_stream_pieces_join_to_the_reply(chat_llm):
    conv = chat_llm.conversation()
    pieces = list(conv.stream("Count to five.", max_new_tokens=20))
    assert "".join(pieces) == conv.last_reply.text
    conv.close()


def test_stop_string_cuts_reply_and_next_turn_still_matches_recompute(chat_llm):
    probe = chat_llm.conversation()
    full = probe.send("Say something.", max_new_tokens=20).text
    probe.close()
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "the probe reply is too short to pick a stop string"
    conv = chat_llm.conversation()
    reply = conv.send("Say something.", max_new_tokens=20, stop=[stop])
    assert reply.finish_reason == "stop" and stop not in reply.text and full.startswith(reply.text)
    # The kept tokens run past the cut; the next turn must roll back to what the template renders.
    second = conv.send("Go on.", max_new_tokens=6)
    turn = conv.turns[-1]
    assert greedy_from_scratch(chat_llm, conv.tokens[: turn.prompt_end], 6) == second.token_ids
    assert conv.kv.next_position == len(conv.tokens) - 1
    conv.close()


def test_the_template_names_what_it_writes_after_a_reply(smol_tokenizer):
    assert chat_template.reply_end(smol_tokenizer) == "<|im_end|>\n"


@pytest.mark.parametrize("end", ["<|im_end|>", "<|im_start|>"])
def test_a_generated_special_token_keeps_the_next_turn_on_every_kept_token(chat_llm, monkeypatch, request, end):
    """A reply's text skips the special tokens the model generated inside it, so a client sends the
    reply back without them: the next turn still continues every kept token (a compressing recipe's
    server conversation could not roll back, and would prefill the whole history again). The reply's
    end token renders only where the template writes it: a model config may name other end ids (one
    transformers version gives this tiny model <|im_start|> as its end of sequence)."""
    tok = chat_llm.tokenizer
    eos = tok.convert_tokens_to_ids(end)
    monkeypatch.setattr(chat_llm, "eos_ids", {*chat_llm.eos_ids, eos})
    template_end = tok.eos_token
    tok.eos_token = end  # a tokenizer attribute that monkeypatch cannot undo; restored below
    request.addfinalizer(lambda: setattr(tok, "eos_token", template_end))
    special = next(t for t in tok.all_special_ids if t not in chat_llm.eos_ids)
    words = chat_template.encode(tok, "The sea is deep.")
    for forced, finish in [([words[0], special, *words[1:], eos], "stop"), ([*words, special], "forced")]:
        conv = chat_llm.conversation()
        reply = conv.send("Hello.", force=forced)
        assert reply.finish_reason == finish and reply.text == "The sea is deep."
        assert conv.messages[-1] == {"role": "assistant", "content": "The sea is deep."}
        next_text = chat_template.render(tok, [*conv.messages, {"role": "user", "content": "More."}])
        assert next_text.startswith(conv.text)
        assert conv.text.endswith("deep." + (end if finish == "stop" and end == "<|im_end|>" else ""))
        kept = len(conv.tokens)
        second = conv.send("More.", max_new_tokens=3)
        assert second.cached_tokens == kept - 1  # every kept token but the last reply token, never fed
        assert conv.tokens[: kept] == [*conv.tokens[: kept - len(forced)], *forced]
        turn = conv.turns[-1]
        assert greedy_from_scratch(chat_llm, conv.tokens[: turn.prompt_end], 3) == second.token_ids
        conv.close()


def test_abandoned_stream_undoes_the_turn(chat_llm):
    conv = chat_llm.conversation()
    conv.send("First.", max_new_tokens=4)
    snapshot = (list(conv.tokens), list(conv.messages), conv.kv.next_position, conv.kv.bytes())
    stream = conv.stream("Second.", max_new_tokens=30)
    next(stream)
    stream.close()
    assert (conv.tokens, conv.messages, conv.kv.next_position, conv.kv.bytes()) == snapshot
    conv.close()


def test_a_message_that_is_not_text_and_bad_sampling_are_clear_errors(chat_llm):
    conv = chat_llm.conversation()
    for bad in (None, 3, ["hi"]):
        with pytest.raises(InvalidRequestError, match="the message must be text"):
            conv.send(bad)
    for kwargs, match in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": "x"}, "seed"),
                          ({"stop": [""]}, "stop"), ({"temperature": float("nan")}, "temperature"),
                          ({"bogus": 1}, "bogus")]:
        with pytest.raises(InvalidRequestError, match=match):
            conv.send("hi", **kwargs)
    assert conv.tokens == [] and conv.kv.bytes() == 0
    assert conv.send("hi", max_new_tokens=2).completion_tokens == 2
    conv.close()


def test_context_overflow_leaves_the_conversation_usable(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", max_model_len=120)
    conv = llm.conversation()
    conv.send("Hi.", max_new_tokens=4)
    snapshot = (list(conv.tokens), list(conv.messages), conv.kv.next_position)
    with pytest.raises(ContextLengthError, match="120"):
        conv.send("word " * 200)
    assert (conv.tokens, conv.messages, conv.kv.next_position) == snapshot
    with pytest.raises(ContextLengthError, match=r"max_new_tokens is 200 but the prompt \(\d+ tokens\) leaves room "
                                                 r"for \d+ in the model's context of 120"):
        conv.send("Short?", max_new_tokens=200)  # as the server's 400 for such a max_tokens
    assert (conv.tokens, conv.messages, conv.kv.next_position) == snapshot
    reply = conv.send("Short?")  # no limit given: generation stops at the context edge
    assert reply.finish_reason == "length" and conv.kv.next_position == 119
    conv.close()


def test_full_kv_pool_fails_the_turn_and_keeps_every_conversation(chat_model_dir):
    # No CPU tier (state_cpu_memory=0): an idle conversation has nowhere to go, so the pool stays full
    # (with one, it would be demoted instead; tests/state/test_tiers_engine.py covers that).
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=8 * 2 * (2 * 16 * 16 * 4),  # pages x layers x page bytes
                     state_cpu_memory=0)
    # 8 pages of 16 tokens per layer: 2 KV heads -> 64 tokens fit.
    assert llm.pool.num_pages == 8
    a = llm.conversation()
    a.send("Hi.", max_new_tokens=3)
    snapshot = (list(a.tokens), a.kv.next_position, a.kv.bytes())
    b = llm.conversation()
    with pytest.raises(KVCacheFullError, match="KV pool full"):
        b.send("A long message " * 8, max_new_tokens=3)
    assert b.kv.bytes() == 0 and b.tokens == []
    assert (a.tokens, a.kv.next_position, a.kv.bytes()) == snapshot
    with pytest.raises(KVCacheFullError):
        a.send("Going on and on and on.", max_new_tokens=40)  # fails mid-turn, during decode
    assert (a.tokens, a.kv.next_position, a.kv.bytes()) == snapshot
    a.close()
    assert b.send("A long message " * 8, max_new_tokens=3).completion_tokens == 3


def test_reset_forgets_everything(chat_llm):
    conv = chat_llm.conversation(system="sys")
    first = conv.send("Hello.", max_new_tokens=5)
    conv.send("More.", max_new_tokens=5)
    conv.reset()
    assert conv.kv.bytes() == 0 and conv.tokens == [] and conv.messages == [{"role": "system", "content": "sys"}]
    assert conv.send("Hello.", max_new_tokens=5).token_ids == first.token_ids
    conv.close()
