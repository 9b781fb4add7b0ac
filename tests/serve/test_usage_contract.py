"""OpenAI's usage contract: prompt_tokens counts the whole prompt, reused tokens included, so
cached_tokens <= prompt_tokens on every response, whatever the request does to a stored conversation:
continue it, edit or drop earlier messages, pin it to a session, resume it after a restart, compress
it, or take it back from the CPU tier."""

from __future__ import annotations

import turnkv
from tests.serve.conftest import MODEL, running

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
TURNS = ["Name three rivers.", "Which is longest?", "How long is it?", "And the shortest?"]


def _ask(s, messages, session=None, recipe=None):
    body = {"recipe": recipe} if recipe else None
    r = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_headers={"X-Session-Id": session} if session else None,
                                           extra_body=body)
    usage = r.usage
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens, (messages, usage)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return {"role": "assistant", "content": r.choices[0].message.content}, usage


def _requests(s, session=None, recipe=None) -> list:
    """A conversation, then requests that edit it: a changed earlier message, a dropped tail, a
    longer system prompt, only the last message."""
    usages, messages = [], [SYSTEM]
    for turn in TURNS[:3]:
        messages.append({"role": "user", "content": turn})
        reply, usage = _ask(s, messages, session, recipe)
        messages.append(reply)
        usages.append(usage)
    edited = [*messages[:3], {"role": "user", "content": "Which is widest?"}]
    dropped = messages[:2]
    longer = [{"role": "system", "content": SYSTEM["content"] + " Be brief."}, *messages[1:4]]
    alone = [{"role": "user", "content": TURNS[3]}]
    for variant in (edited, dropped, longer, alone):
        usages.append(_ask(s, variant, session, recipe)[1])
    return messages, usages


def test_cached_tokens_never_exceed_prompt_tokens(chat_model_dir, tmp_path):
    disk = tmp_path / "tier"
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    kept = {}
    with running(llm, served_model_name=MODEL) as s:
        for session in (None, "alice"):
            kept[session], usages = _requests(s, session)
            assert any(u.prompt_tokens_details.cached_tokens > 0 for u in usages)  # reuse did happen
        _requests(s, "bob", recipe="snapkv budget=16")
        # Idle conversations to the CPU tier and back.
        for entry in list(s.store.entries):
            s.store.tiers.offload(entry.conv)
            entry.conv.kv.free()
        _ask(s, [*kept[None], {"role": "user", "content": TURNS[3]}])
        # The conversations as the first three turns left them, for the restarted server.
        for session in (None, "alice"):
            _ask(s, kept[session][:-1], session)
    # A restarted server over the same disk continues what the first one left there.
    again = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    with running(again, served_model_name=MODEL) as s:
        assert s.store.entries
        for session in (None, "alice"):
            messages = [*kept[session], {"role": "user", "content": TURNS[3]}]
            _ask(s, messages, session)
            _ask(s, [*messages, {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Go on."}],
                 session)
            _ask(s, [SYSTEM, {"role": "user", "content": "Something else entirely."}], session)
