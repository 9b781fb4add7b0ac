"""A restart under every evicting preset gives the reply an uninterrupted conversation gives: the
method state that decides later compressions (the observation window, the decode schedule's count,
FlowKV's frozen span) is stored with the KV on disk and restored with it."""

from __future__ import annotations

import pytest

import turnkv
from turnkv.methods.recipe import _preset_table

MESSAGES = ["Hello, who are you? Tell me a long story about the sea.",
            "Tell me about the sea and the mountains and rivers.", "And about mountains?"]
SYSTEM = "You are a storyteller."
EVICTING = [name for name, spec in _preset_table().items() if "evict" in spec]
SAMPLING = {"max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB")


@pytest.mark.parametrize("preset", EVICTING)
def test_every_evicting_preset_continues_after_a_restart_as_without_one(chat_model_dir, llm, tmp_path, preset):
    recipe = f"{preset} budget=40"
    reference = llm.conversation(system=SYSTEM, recipe=recipe)
    want = [reference.send(m, **SAMPLING).token_ids for m in MESSAGES]
    assert reference.compression_log  # the budget is small enough that it evicts
    reference.close()

    first = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", state_disk_dir=tmp_path)
    conv = first.conversation(system=SYSTEM, recipe=recipe)
    got = [conv.send(m, **SAMPLING).token_ids for m in MESSAGES[:2]]
    assert conv.offload("disk") == "disk"
    restarted = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", state_disk_dir=tmp_path)
    again = restarted.resume(conv.id)
    third = again.send(MESSAGES[2], **SAMPLING)
    assert third.cached_tokens == again.turns[-1].start  # continued from the stored KV
    assert [*got, third.token_ids] == want
