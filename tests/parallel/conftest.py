"""Fixtures of the tensor-parallel tests: one engine at N=1 and one at N=2 (gloo on CPU, fp32) over the
same tiny random chat model, shared by the module's tests (starting the workers takes seconds)."""

from __future__ import annotations

import pytest

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from turnkv.parallel.kept import kept

TIMEOUT_S = "120"  # collectives and answers: generous for a loaded CI machine, short of a hang


@pytest.fixture(scope="session")
def tp_engines(chat_model_dir):
    """(engine at N=1, engine at N=2): the same weights, each rank of N=2 with half the pool."""
    import turnkv

    mp = pytest.MonkeyPatch()
    mp.setenv("TURNKV_TP_TIMEOUT", TIMEOUT_S)
    single = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", prefix_cache="off")
    pair = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", prefix_cache="off", tensor_parallel=2)
    yield single, pair
    pair.shutdown()
    mp.undo()


def three_turns(llm, recipe: str, **sampling):
    """A conversation of three turns under `recipe`: (token ids of each reply, {(layer, KV head): positions
    kept} after the last turn, over every rank)."""
    conv = llm.conversation(system=SYSTEM, recipe=recipe)
    try:
        tokens = [conv.send(message, max_new_tokens=NEW, ignore_eos=True, **sampling).token_ids
                  for message in MESSAGES[:3]]
        return tokens, kept(conv)
    finally:
        conv.close()
