"""The capacity benchmark's client (benchmarks/serving/capacity_client.py) against a stub of the
openai client: a deadline leaves the turns it would start unplayed, and a server error ends only
that user's conversation; the report counts both apart from the played turns."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serving"))

import capacity_client  # noqa: E402
import capacity_report  # noqa: E402
from capacity_workload import User  # noqa: E402


class Stream:
    """One streamed reply: a text chunk, then the usage chunk."""

    def __init__(self):
        self.chunks = [SimpleNamespace(usage=None, choices=[SimpleNamespace(delta=SimpleNamespace(content="ok"))]),
                       SimpleNamespace(usage=SimpleNamespace(prompt_tokens=10, completion_tokens=1,
                                                             prompt_tokens_details=None), choices=[])]

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self.chunks:
            yield c


def stub_client(fail_user: int | None = None, seconds: float = 0.05):
    async def create(messages, **kwargs):
        if fail_user is not None and f"user {fail_user}" in messages[1]["content"]:
            raise openai.APIError("internal server error", request=None, body=None)
        await asyncio.sleep(seconds)
        return Stream()

    return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def user(index: int, arrival_s: float, think_s: float) -> User:
    return User(index=index, arrival_s=arrival_s, document=f"user {index}", turns=3, think_s=[think_s] * 2,
                questions=["q1", "q2", "q3"])


def test_a_deadline_leaves_later_turns_unplayed():
    records, t0 = [], time.perf_counter()
    users = [user(0, 0.0, 0.0), user(1, 0.0, 0.3)]  # user 1 thinks past the deadline before turn 2

    async def play():
        await asyncio.gather(*(capacity_client.converse(stub_client(), u, 1, t0, records, deadline_s=0.2)
                               for u in users))

    asyncio.run(play())
    played = sorted((r["user"], r["turn"]) for r in records if "unplayed" not in r)
    unplayed = sorted((r["user"], r["turn"]) for r in records if "unplayed" in r)
    assert played == [(0, 1), (0, 2), (0, 3), (1, 1)] and unplayed == [(1, 2), (1, 3)]
    summary = capacity_report.summarise(records, 1.0, [(1.0, {})])
    assert summary["requests"] == 6 and summary["unplayed"] == 2 and summary["failed"] == 0
    assert summary["output_tokens"] == 4


def test_a_server_error_ends_that_users_conversation_only():
    records, t0 = [], time.perf_counter()

    async def play():
        client = stub_client(fail_user=1)
        await asyncio.gather(*(capacity_client.converse(client, u, 1, t0, records) for u in
                               (user(0, 0.0, 0.0), user(1, 0.0, 0.0))))

    asyncio.run(play())
    assert sorted((r["user"], r["turn"]) for r in records if "failed" not in r) == [(0, 1), (0, 2), (0, 3)]
    failed = [r for r in records if "failed" in r]
    assert len(failed) == 1 and failed[0]["user"] == 1 and "internal server error" in failed[0]["failed"]
    assert capacity_report.summarise(records, 1.0, [(1.0, {})])["failed"] == 1


def test_a_cut_ends_the_run_with_turns_in_flight_unfinished():
    """At cut_s the conversations still going are cancelled: the turn in flight is unfinished, the
    rest unplayed, and the run returns (it would otherwise wait for the slow replies)."""
    records, t0 = [], time.perf_counter()
    users = [user(0, 0.0, 0.0), user(1, 0.0, 0.0)]

    async def play():
        await capacity_client.play_all(stub_client(seconds=0.2), users, 1, t0, records, cut_s=0.5)

    asyncio.run(play())
    assert time.perf_counter() - t0 < 1.0
    for u in (0, 1):  # turns 1 and 2 took 0.4 s; turn 3 was in flight at 0.5 s
        mine = {r["turn"]: r for r in records if r["user"] == u}
        assert "unfinished" not in mine[1] and "unfinished" not in mine[2] and mine[3] == {
            "user": u, "turn": 3, "unfinished": True}
    summary = capacity_report.summarise(records, 1.0, [(1.0, {})])
    assert (summary["requests"], summary["unfinished"], summary["unplayed"], summary["failed"]) == (6, 2, 0, 0)
    assert summary["output_tokens"] == 4
