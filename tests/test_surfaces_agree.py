"""The library, the command line and the server give one answer to the same request: a reply longer
than the context has room for, an empty message or prompt, a turn on a closed conversation, the
stats of a budget that has not evicted, the name of the KV pool's tier, and --quiet-stats."""

from __future__ import annotations

import re

import httpx
import pytest

import turnkv
from tests.serve.conftest import running
from tests.test_cli_first_hour import run_cli
from turnkv.serve.config import ServeConfig
from turnkv.serve.server import startup_summary

CONTEXT = 512  # the tiny chat model's (tests/conftest.py TINY)
HELLO = [{"role": "user", "content": "Hello."}]
RAW = "Hello there. " * 8  # a raw prompt long enough that CONTEXT - 5 new tokens do not fit after it


@pytest.fixture(scope="module")
def server(chat_llm):
    with running(chat_llm, served_model_name="tiny") as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


@pytest.mark.parametrize("tokens", [200_000, CONTEXT, CONTEXT - 5])
def test_a_reply_the_context_has_no_room_for_is_refused_everywhere(chat_llm, server, monkeypatch, capsys,
                                                                   chat_model_dir, tokens):
    conv = chat_llm.conversation()
    with pytest.raises(turnkv.ContextLengthError, match=rf"max_new_tokens is {tokens} but the prompt \(\d+ tokens\) "
                                                        rf"leaves room for \d+ in the model's context of {CONTEXT}"):
        conv.send("Hello.", max_new_tokens=tokens)
    assert conv.tokens == [] and conv.kv.bytes() == 0 and conv.send("Hello.", max_new_tokens=2).completion_tokens == 2
    conv.close()
    with pytest.raises(turnkv.ContextLengthError, match=f"max_new_tokens is {tokens}"):
        chat_llm.generate(RAW, max_new_tokens=tokens)
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": RAW})):
        r = post(server, path, {**body, "max_tokens": tokens})
        assert r.status_code == 400 and f"max_tokens is {tokens}" in r.json()["error"]["message"], r.text
    # The command line: a limit no prompt leaves room for fails before the model loads; one that only
    # this prompt leaves no room for fails the turn, and the chat goes on.
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--kv-memory", "32MiB",
                                                   "--max-new-tokens", str(tokens)], "Hello.\n/stats\n")
    if tokens >= CONTEXT:
        assert code == 2 and err.strip().splitlines()[-1] == (
            f"error: --max-new-tokens {tokens} does not fit {chat_model_dir}'s context of {CONTEXT} tokens: a reply "
            f"can take at most {CONTEXT - 1} (the prompt takes at least one)")
        assert "loading" not in err
    else:
        assert code == 0 and f"error: max_new_tokens is {tokens} but the prompt" in err and "turns: 0" in out


def test_an_empty_message_is_a_turn_and_an_empty_raw_prompt_an_error_everywhere(chat_llm, server, monkeypatch,
                                                                                capsys, tmp_path):
    conv = chat_llm.conversation()
    reply = conv.send("", max_new_tokens=2)
    assert reply.completion_tokens == 2 and conv.messages[0] == {"role": "user", "content": ""}
    conv.close()
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    # A raw prompt with no text has nothing to continue from.
    with pytest.raises(turnkv.InvalidRequestError, match="the prompt is empty"):
        chat_llm.generate("")
    r = post(server, "/v1/completions", {"prompt": "", "max_tokens": 2})
    assert r.status_code == 400 and "the prompt is empty" in r.json()["error"]["message"], r.text
    # The command line says so before the model loads: this model does not even exist.
    code, _, err = run_cli(monkeypatch, capsys, ["generate", "", "--model", str(tmp_path / "no-such-model")])
    assert code == 2 and err.strip() == "error: the prompt is empty"


def test_a_closed_conversation_takes_no_more_turns(chat_llm):
    conv = chat_llm.conversation()
    conv.send("Hello.", max_new_tokens=2)
    conv.close()
    used = chat_llm.pool.bytes_in_use()
    for turn in (lambda: conv.send("Again."), lambda: conv.stream("Again.")):
        with pytest.raises(turnkv.InvalidRequestError, match="this conversation is closed"):
            turn()
    assert chat_llm.pool.bytes_in_use() == used and conv.kv.bytes() == 0  # nothing was prefilled again


@pytest.mark.parametrize("budget,evicts", [(1024, False), (8, True)])
def test_stats_and_the_compression_log_agree_on_whether_a_budget_evicted(chat_llm, monkeypatch, capsys,
                                                                         chat_model_dir, budget, evicts):
    messages = ["Hello there, how are you today?", "And again?"]
    conv = chat_llm.conversation(recipe="snapkv", budget=budget)
    for message in messages:
        conv.send(message, max_new_tokens=3)
    assert bool(conv.compression_log) == evicts
    for entry in conv.compression_log:  # each entry evicted something from the span it names
        assert sum(map(sum, entry["kept_per_head"])) < conv.kv.next_position * 2 * 2
    conv.close()
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                   "--kv-memory", "32MiB", "--recipe", "snapkv", "--budget",
                                                   str(budget)], "\n".join(messages) + "\n/stats\n")
    assert code == 0, err
    assert ("nothing evicted yet" in out) == (not evicts) and ("last compression" in out) == evicts


def test_the_kv_pools_tier_has_one_name(chat_llm, monkeypatch, capsys, chat_model_dir):
    code, stats, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "2",
                                                     "--kv-memory", "32MiB"], "Hello.\n/stats\n")
    assert code == 0, err
    code, presets, _ = run_cli(monkeypatch, capsys, ["methods", "--presets"])
    summary = startup_summary(chat_llm, ServeConfig())
    for said in (stats, presets, summary):
        assert "state=gpu" in said and "resident" not in said
    assert re.search(r"^state: gpu", stats, flags=re.MULTILINE)


def test_quiet_stats_leaves_out_the_stats_line(monkeypatch, capsys, chat_model_dir):
    argv = ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "2", "--kv-memory", "32MiB"]
    said = {}
    for quiet in (False, True):
        code, out, err = run_cli(monkeypatch, capsys, argv + ["--quiet-stats"] * quiet, "Hello.\nAgain.\n")
        assert code == 0, err
        said[quiet] = len(re.findall(r"reused tokens \| KV", out + err))
    assert said == {False: 2, True: 0}
