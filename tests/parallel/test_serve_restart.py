"""A server on a tensor-parallel engine keeps its idle conversations in the disk tier across a restart (gloo
on CPU, fp32, the tiny chat model, Ada-KV so that each rank's heads keep their own tokens): at N=2 each rank
leaves its shard in its own folder when the server stops, and a server on a new engine at N=2 over the same
folder takes them back and continues them with the replies and cached tokens of N=1 doing the same. A
server of another size takes none of them back and logs what it leaves there; resuming one at another
size names the size that stored it."""

from __future__ import annotations

import contextlib
import logging

import pytest

from tests.parallel.conftest import TIMEOUT_S
from tests.serve.conftest import MODEL, running
from turnkv.errors import InvalidRequestError

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
TURNS = ["Name three rivers.", "Which is longest?", "How long is it?"]
SESSIONS = (None, "alice")  # one conversation continued by its text, one pinned to a session


def build(path, size: int, disk):
    import turnkv

    return turnkv.LLM(str(path), device="cpu", kv_memory="32MiB" if size == 1 else "16MiB", tensor_parallel=size,
                      state_disk_dir=str(disk), recipe="ada-snapkv", keep_ratio=0.5)


@contextlib.contextmanager
def warnings_logged():
    """The messages of the warnings the server logs meanwhile."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("turnkv.serve")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def restart(path, size: int, disk) -> dict:
    """Both conversations play two turns on a server at `size`, which stops; a server on a new engine at
    `size` over the same folder plays their third turns. {"replies": per conversation [(reply, cached
    tokens)] per turn, "taken": the tier of each conversation the second server took back, "ids": their
    ids, "warned": what each server logged at its start}."""
    history = {session: [SYSTEM] for session in SESSIONS}
    out = {"replies": {session: [] for session in SESSIONS}, "warned": []}
    for turns in (TURNS[:2], TURNS[2:]):
        llm = build(path, size, disk)
        try:
            with warnings_logged() as warned, running(llm, served_model_name=MODEL) as s:
                out["warned"].append(list(warned))
                if turns == TURNS[2:]:
                    out["taken"] = [s.store.where(e) for e in s.store.entries]
                    out["ids"] = {e.session: e.conv.id for e in s.store.entries}
                for turn in turns:
                    for session in SESSIONS:
                        history[session].append({"role": "user", "content": turn})
                        r = s.client().chat.completions.create(
                            model=MODEL, messages=history[session], max_tokens=8, temperature=0,
                            extra_headers={"X-Session-Id": session} if session else None)
                        reply = r.choices[0].message.content
                        history[session].append({"role": "assistant", "content": reply})
                        out["replies"][session].append((reply, r.usage.prompt_tokens_details.cached_tokens))
        finally:
            llm.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(chat_model_dir, tmp_path_factory):
    """N=1's restart, then N=2's over the same folder, then a server at N=1 over it once more: (N=1's,
    N=2's, the last server's {"taken": {id: tier}, "warned"}, the last engine's refusal to resume N=2's
    unpinned conversation)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TURNKV_TP_TIMEOUT", TIMEOUT_S)
    disk = tmp_path_factory.mktemp("restart")
    try:
        one = restart(chat_model_dir, 1, disk)
        two = restart(chat_model_dir, 2, disk)
        llm = build(chat_model_dir, 1, disk)
        with warnings_logged() as warned, running(llm, served_model_name=MODEL) as s:
            last = {"taken": {e.conv.id: s.store.where(e) for e in s.store.entries}, "warned": list(warned)}
        with pytest.raises(InvalidRequestError) as refused:
            llm.resume(two["ids"][None])
        yield one, two, last, str(refused.value), disk
    finally:
        mp.undo()


def test_a_restarted_server_at_n2_continues_its_conversations_as_n1_does(runs):
    one, two, _, _, disk = runs
    assert two["replies"] == one["replies"]
    assert two["taken"] == one["taken"] == ["disk", "disk"]
    # Every later turn reused its conversation's history, the third from the disk tier.
    assert all(cached > 0 for turns in two["replies"].values() for _, cached in turns[1:])
    # Each rank left its shard of each conversation in its own folder.
    for rank in range(2):
        assert sorted(p.stem for p in (disk / f"tp2-rank{rank}").glob("*.json")) == sorted(two["ids"].values())


def test_a_server_of_another_size_takes_none_back_and_says_so(runs):
    one, two, last, refused, _ = runs
    # N=2's servers left N=1's conversations where they were, and said so.
    assert all(any("2 stored conversations" in m and "tensor_parallel=1" in m for m in warned)
               for warned in two["warned"])
    # A server at N=1 takes back N=1's conversations only, and says what N=2 left.
    assert last["taken"] == {cid: "disk" for cid in one["ids"].values()}
    assert any("2 stored conversations" in m and "tensor_parallel=2" in m for m in last["warned"])
    assert f"no stored conversation has the id {two['ids'][None]!r}" in refused
    assert "an engine at tensor_parallel=2 stored it" in refused


def test_a_conversation_not_held_alike_by_every_rank_is_left_on_disk(tmp_path, caplog):
    """kept() takes back only what every rank's folder holds with the same history: one that a rank lacks,
    or holds with other tokens, stays on disk (logged), and no rank takes it back."""
    from types import SimpleNamespace

    from turnkv.serve import lockstep_tiers

    held = [{"same": (3, 7), "other": (3, 7), "missing": (3, 7)}, {"same": (3, 7), "other": (3, 8)}]
    taken = []

    class Ops:
        llm = None

        def run(self, op, cid):
            assert op is lockstep_tiers.take_back
            taken.append(cid)
            return SimpleNamespace(id=cid)

    tiers = SimpleNamespace(disk=object(), meta=lambda cid: {"last_used": 5.0})
    manager = SimpleNamespace(tiers=tiers, disk_root=lambda: (tmp_path, 2))
    hook = lockstep_tiers.LockstepTiers(Ops(), SimpleNamespace(names=("cpu", "disk"), manager=manager))
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, "turnkv.serve"):
        mp.setattr(lockstep_tiers, "gather", lambda llm, fn: held)
        kept = hook.kept()
    assert taken == ["same"] and [(conv.id, used) for conv, used in kept] == [("same", 5.0)]
    left = [r.getMessage() for r in caplog.records if "not held alike" in r.getMessage()]
    assert len(left) == 2 and any("missing" in m for m in left) and any("other" in m for m in left)
