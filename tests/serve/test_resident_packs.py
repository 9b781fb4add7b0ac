"""The server's resident packs (ServeConfig.resident_packs, on by default; `--leave-after-turn` turns
them off): a conversation whose recipe packs it after every turn (state=krul) stays in the KV pool with
a copy in the CPU tier, so its next turn restores nothing and reads the KV it left, as a conversation
that never left does. Off, it leaves at its turn's end and comes back through a restore."""

from __future__ import annotations

import httpx
import pytest

import turnkv
from tests.serve.conftest import MODEL, running, wait_for
from turnkv.state.schedule import CostModel

KRUL = "state=krul(ir_threshold=0,fallback=never)"  # every pair merged: a restore would change the KV
FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_cpu_memory="64MiB")
    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    return llm


def turn(url: str, messages: list[dict], recipe: str = KRUL) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "recipe": recipe})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def two_turns(url: str, recipe: str = KRUL, between=lambda: None) -> tuple[str, str]:
    one = turn(url, FIRST, recipe)
    between()
    return one, turn(url, FIRST + [{"role": "assistant", "content": one}, {"role": "user", "content": "And then?"}],
                     recipe)


def test_a_packed_conversation_stays_resident_and_its_next_turn_restores_nothing(llm):
    with running(llm, served_model_name=MODEL, background_packs=False) as s:
        never_left = two_turns(s.url, "state=gpu")  # the same KV, kept on the GPU
    llm.state.pack_inline()

    def landed_and_resident():
        wait_for(lambda: s.metric("turnkv:state_packs_completed") >= 1, what="the pack")
        [entry] = s.store.entries
        # Done, and taken by the worker's next iteration with work (the next turn's begin, here).
        assert entry.conv.id in llm.state.copies or llm.state.leaving[entry.conv.id].job.future.done()
        assert llm.state.where(entry.conv) == "gpu" and entry.conv.kv.bytes() > 0
        assert llm.state.tiers.tier_of(entry.conv.id) == "cpu"  # the copy

    with running(llm, served_model_name=MODEL) as s:  # resident packs: the default
        assert llm.state.resident_packs
        replies = two_turns(s.url, between=landed_and_resident)
        assert s.metric("turnkv:tier_traffic_bytes_total", direction="restore") == 0
    assert replies == never_left
    llm.state.pack_inline()


def test_leaving_after_the_turn_restores_the_next_one(llm):
    with running(llm, served_model_name=MODEL, resident_packs=False) as s:
        assert not llm.state.resident_packs
        two_turns(s.url, between=lambda: wait_for(lambda: s.metric("turnkv:state_packs_completed") >= 1,
                                                  what="the pack"))
        assert s.metric("turnkv:tier_traffic_bytes_total", direction="restore") > 0
    llm.state.pack_inline()
