"""Where a later turn's TTFT goes through `turnkv serve`, phase by phase.

The server runs in this process (`turnkv serve`'s own code, uvicorn in a thread), with the request
path's steps wrapped by timers: reading the request, rendering the chat (plan), the worker picking
the request up, claiming the kept conversation, encoding the new text, beginning the turn, the
prefill, the first token's event, and the client's first SSE line. One conversation sends --turns
turns as serve_bench.py does (a --history-token document, then short questions, greedy replies of
--max-tokens). Then the same turns go through `conv.send` on a second engine in this process, the
library's path, for the engine's own TTFT.

    python benchmarks/serving/ttft_breakdown.py --model llama-3.1-8b --dtype bfloat16 --device cuda \
        --history 8192 --turns 10 --max-tokens 32 --prefill-chunk 32768 --out results/ttft-breakdown

--sync-probe synchronises the device before each prefill and reports how long that waited: GPU work
still queued when the prefill starts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import QUESTIONS, conversation_args, free_port, history_text  # noqa: E402

EVENTS: list[tuple[str, float, float]] = []  # (phase, start, end), perf_counter seconds


def timed(owner, name: str, phase: str, before=None) -> None:
    """Wrap owner.name so each call records (phase, start, end); before(), if given, runs first and
    its wait is recorded as phase + ' wait'."""
    fn = getattr(owner, name)

    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                EVENTS.append((phase, start, time.perf_counter()))
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if before is not None:
                start = time.perf_counter()
                before()
                EVENTS.append((phase + " wait", start, time.perf_counter()))
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                EVENTS.append((phase, start, time.perf_counter()))
    setattr(owner, name, wrapper)


def instrument(sync_probe: bool, device: str | None) -> None:
    import torch

    from turnkv.engine import prefix, runner, turn
    from turnkv.serve import app, chat, scheduler, store
    from turnkv.serve.job import Job

    sync = (lambda: torch.cuda.synchronize()) if sync_probe and device == "cuda" else None
    timed(app, "read_request", "read request")
    timed(chat, "plan", "plan (render)")
    timed(scheduler.Scheduler, "submit", "submit")
    timed(Job, "claim", "claim")
    timed(Job, "encode", "encode")
    timed(Job, "ready", "ready (begin turn)")
    timed(Job, "prefill", "prefill", before=sync)
    timed(turn.TurnRun, "prefill", "  turn prefill (forward + recipe hooks)")
    timed(runner.ModelRunner, "prefill", "    forward")
    timed(turn.TurnRun, "take", "  take the first token")
    timed(scheduler.Scheduler, "_first_token", "first token event")
    timed(Job, "finish", "finish")
    timed(turn.TurnRun, "finish", "  turn finish")
    timed(prefix, "_insert", "    prefix index insert")
    timed(store.ConversationStore, "release", "  store release")
    original = app.Stream.push

    def push(self, kind, payload):
        EVENTS.append((f"push {kind}", time.perf_counter(), time.perf_counter()))
        return original(self, kind, payload)

    app.Stream.push = push


def start_server(args, port: int) -> None:
    from turnkv import cli

    argv = ["serve", "--port", str(port), "--served-model-name", "bench", "--max-running", "1",
            "--prefill-chunk", str(args.prefill_chunk), "--log-level", "warning"]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--recipe", args.recipe), ("--tokenizer", args.tokenizer),
                        ("--kv-memory", args.kv_memory)):
        if value is not None:
            argv += [flag, value]
    parsed = cli.build_parser().parse_args(argv)
    threading.Thread(target=parsed.func, args=(parsed,), daemon=True, name="server").start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


async def one_turn(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    first, text = None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    return {"sent": start, "first": first, "end": time.perf_counter(), "text": "".join(text)}


async def conversation(url: str, document: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": "You answer questions about documents."},
                {"role": "user", "content": f"{document}\n\n{QUESTIONS[0]}"}]
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as client:
        for t in range(turns):
            result = await one_turn(client, url, messages, max_tokens)
            out.append(result)
            messages += [{"role": "assistant", "content": result["text"]},
                         {"role": "user", "content": QUESTIONS[(t + 1) % len(QUESTIONS)]}]
    return out


def phases_of(turn: dict) -> dict[str, float]:
    """Milliseconds from the client's send to the start and end of each phase inside this request."""
    out = {}
    for phase, start, end in EVENTS:
        if turn["sent"] <= start <= turn["end"] and phase not in out:
            out[phase] = ((start - turn["sent"]) * 1000, (end - start) * 1000)
    out["client first line"] = ((turn["first"] - turn["sent"]) * 1000, 0.0)
    return out


def library_ttft(args, document: str, replies: list[str]) -> list[float]:
    """The same turns through conv.send on an engine of the same settings (the replies the server
    gave are fed back as the assistant's turns, as the HTTP client did)."""
    from turnkv.engine.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer, kv_memory=args.kv_memory,
              recipe=args.recipe, prefill_chunk=args.prefill_chunk)
    conv = llm.conversation(system="You answer questions about documents.")
    ttft = []
    for t in range(args.turns):
        text = f"{document}\n\n{QUESTIONS[0]}" if t == 0 else QUESTIONS[t % len(QUESTIONS)]
        reply = conv.send(text, max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        ttft.append(reply.ttft_s * 1000)
    return ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    conversation_args(p, turns=6)  # --kv-memory: each engine's pool (the server's and conv.send's share the device)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--sync-probe", action="store_true")
    p.add_argument("--no-library", action="store_true", help="skip the conv.send comparison")
    p.add_argument("--out", default=None, help="path stem for .json and .md results")
    args = p.parse_args()

    from turnkv.engine.llm import _load_tokenizer

    instrument(args.sync_probe, args.device)
    document = history_text(_load_tokenizer(args.tokenizer), args.history, 0)
    url = start_server(args, free_port())
    turns = asyncio.run(conversation(url, document, args.turns, args.max_tokens))
    rows = [phases_of(t) for t in turns]
    names = []
    for row in rows:
        names += [n for n in row if n not in names]
    names = [n for n in names if any(n in r for r in rows[1:])]  # phases of later turns (not turn 1's alone)
    names.sort(key=lambda n: statistics.median(r[n][0] for r in rows[1:] if n in r))
    lines = [f"# TTFT through turnkv serve, phase by phase: {args.history}-token document, {args.turns} turns",
             "", f"Command: `python {' '.join(sys.argv)}`", "",
             "Each phase's start after the client sent the request and its length, ms, median over turns 2 on.", "",
             "| phase | starts at | lasts |", "|---|---|---|"]
    for n in names:
        later = [r[n] for r in rows[1:] if n in r]
        if later:
            lines.append(f"| {n} | {statistics.median(s for s, _ in later):.2f} | "
                         f"{statistics.median(d for _, d in later):.2f} |")
    lines += ["", "Client TTFT by turn, ms: " + ", ".join(f"{(t['first'] - t['sent']) * 1000:.1f}" for t in turns)]
    library = None
    if not args.no_library:
        library = library_ttft(args, document, [t["text"] for t in turns])
        lines += ["", "conv.send TTFT by turn (the library's path, same engine settings), ms: "
                  + ", ".join(f"{v:.1f}" for v in library)]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "turns": rows, "library_ttft_ms": library,
                                                        "events": EVENTS}, indent=1))
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
