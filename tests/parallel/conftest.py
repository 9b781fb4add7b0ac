"""Fixtures of the tensor-parallel tests: one engine at N=1 and one at N=2 (gloo on CPU, fp32) over the
same tiny random chat model, shared by the module's tests (starting the workers takes seconds)."""

from __future__ import annotations

import pytest

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from turnkv.parallel.kept import kept

TIMEOUT_S = "120"  # collectives and answers: generous for a loaded CI machine, short of a hang


def engine_pair(path, single_memory: str, pair_memory: str, single_options=None, pair_options=None):
    """Yields (engine at N=1, engine at N=2) over the model at `path`, the collectives' timeout set;
    stops N=2's workers after (a fixture's body: `yield from engine_pair(...)`)."""
    import turnkv

    mp = pytest.MonkeyPatch()
    mp.setenv("TURNKV_TP_TIMEOUT", TIMEOUT_S)
    single = turnkv.LLM(str(path), **{"device": "cpu", "kv_memory": single_memory, **(single_options or {})})
    pair = turnkv.LLM(str(path), tensor_parallel=2, **{"device": "cpu", "kv_memory": pair_memory, **(pair_options or {})})
    try:
        yield single, pair
    finally:
        pair.shutdown()
        mp.undo()


@pytest.fixture(scope="session")
def tp_engines(chat_model_dir, tmp_path_factory):
    """(engine at N=1, engine at N=2): the same weights, each rank of N=2 with half the pool; each with
    a disk tier of its own (pair.disk_dir: N=2's)."""
    disk = str(tmp_path_factory.mktemp("disk-2"))
    for single, pair in engine_pair(chat_model_dir, "32MiB", "16MiB",
                                    {"state_disk_dir": str(tmp_path_factory.mktemp("disk-1"))},
                                    {"state_disk_dir": disk}):
        pair.disk_dir = disk
        yield single, pair


def three_turns(llm, recipe: str, offload: str | None = None):
    """A conversation of three turns under `recipe`: (token ids of each reply, {(layer, KV head): positions
    kept} after the last turn, over every rank). offload: a tier ("cpu", "disk") the conversation
    moves to after each of its first two turns, to come back at the next."""
    conv = llm.conversation(system=SYSTEM, recipe=recipe)
    try:
        tokens = []
        for turn, message in enumerate(MESSAGES[:3]):
            tokens.append(conv.send(message, max_new_tokens=NEW, ignore_eos=True).token_ids)
            if offload is not None and turn < 2:
                assert conv.offload(offload) == offload == conv.location
        return tokens, kept(conv)
    finally:
        conv.close()
