"""Drives one running `turnkv serve` with the official `openai` client: every user's conversation
as its own task, streamed replies, and /metrics sampled on the side.

A request's record: user, turn, sent / first / end times (perf_counter seconds from the run's start),
the arrival time of every streamed chunk with text, and the usage the server reports (prompt tokens,
of which cached, completion tokens)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
from capacity_workload import User


async def one_turn(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int, t0: float) -> dict:
    sent = time.perf_counter() - t0
    chunks, text, usage = [], [], None
    stream = await client.chat.completions.create(
        model="bench", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                chunks.append(time.perf_counter() - t0)
                text.append(choice.delta.content)
    end = time.perf_counter() - t0
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"sent": sent, "first": chunks[0] if chunks else end, "end": end, "chunks": chunks,
            "text": "".join(text), "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached or 0,
            "completion_tokens": usage.completion_tokens}


async def converse(client, user: User, max_tokens: int, t0: float, records: list[dict],
                   deadline_s: float | None = None) -> None:
    """Play the user's turns; a turn that would start after `deadline_s` (from t0) is recorded as
    unplayed, and so are the rest. Cancelled (run's cut), the turn in flight is recorded as
    unfinished and the rest as unplayed."""
    state = {"turn": 1, "in_flight": False}
    try:
        await _play(client, user, max_tokens, t0, records, deadline_s, state)
    except asyncio.CancelledError:
        turn = state["turn"]
        if state["in_flight"]:
            records.append({"user": user.index, "turn": turn, "unfinished": True})
            turn += 1
        records.extend({"user": user.index, "turn": t, "unplayed": True} for t in range(turn, user.turns + 1))
        raise


async def _play(client, user: User, max_tokens: int, t0: float, records: list[dict], deadline_s, state) -> None:
    await asyncio.sleep(max(0.0, user.arrival_s - (time.perf_counter() - t0)))
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": user.first_message()}]
    for turn in range(1, user.turns + 1):
        state["turn"] = turn
        if turn > 1:
            await asyncio.sleep(user.think_s[turn - 2])
            messages.append({"role": "user", "content": user.questions[turn - 1]})
        if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
            records.extend({"user": user.index, "turn": t, "unplayed": True} for t in range(turn, user.turns + 1))
            return
        state["in_flight"] = True
        for attempt in range(60):
            try:
                result = await one_turn(client, messages, max_tokens, t0)
                break
            except (openai.RateLimitError, openai.InternalServerError) as e:  # 429 queue full, 503 pool full
                error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(1.0)
            except openai.APIError as e:  # anything else (a 500 mid-stream): this user's conversation ends
                records.append({"user": user.index, "turn": turn, "failed": f"{type(e).__name__}: {e}",
                                "retries": attempt})
                return
        else:
            records.append({"user": user.index, "turn": turn, "failed": error, "retries": attempt + 1})
            return
        state["in_flight"] = False
        result["retries"] = attempt
        records.append({"user": user.index, "turn": turn, **result})
        messages.append({"role": "assistant", "content": result["text"]})


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


async def sample_metrics(url: str, every_s: float, out: list[tuple[float, dict]], t0: float, stop: asyncio.Event):
    while not stop.is_set():
        try:
            samples = await asyncio.to_thread(scrape, url)
            out.append((time.perf_counter() - t0, samples))
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


LAG_EVERY_S, LAG_REPORTED_S = 0.01, 0.1


async def loop_lags(t0: float, out: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """[start, seconds late] of every LAG_EVERY_S sleep this client's event loop ended over
    LAG_REPORTED_S late: the client's own stalls, which its records would count as the server's gaps."""
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(LAG_EVERY_S)
        late = time.perf_counter() - before - LAG_EVERY_S
        if late > LAG_REPORTED_S:
            out.append((round(before - t0, 3), round(late, 3)))


async def play_all(client, users: list[User], max_tokens: int, t0: float, records: list[dict],
                   deadline_s: float | None = None, cut_s: float | None = None) -> None:
    """Every user's conversation at once; at `cut_s` seconds from t0 the ones still going are cancelled
    (their turns recorded as unfinished or unplayed), so a run always ends and reports."""
    plays = asyncio.gather(*(converse(client, u, max_tokens, t0, records, deadline_s) for u in users))
    if cut_s is None:
        await plays
        return
    try:
        await asyncio.wait_for(plays, max(0.0, cut_s - (time.perf_counter() - t0)))
    except asyncio.TimeoutError:
        pass


async def run(url: str, users: list[User], max_tokens: int, sample_s: float = 1.0, deadline_s: float | None = None,
              cut_s: float | None = None):
    """Every user's conversation against the server at `url` (no turn starts after `deadline_s`, and
    turns still running at `cut_s` are cut); returns (records, wall seconds, samples, client loop lags)."""
    records, samples, lags, stop = [], [], [], asyncio.Event()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=httpx.Timeout(7200.0), http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=len(users) + 8), timeout=7200.0))
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_metrics(url, sample_s, samples, t0, stop))
    lagger = asyncio.create_task(loop_lags(t0, lags, stop))
    async with client:
        await play_all(client, users, max_tokens, t0, records, deadline_s, cut_s)
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    await lagger
    samples.append((wall, await asyncio.to_thread(scrape, url)))
    return records, wall, samples, lags
