"""Multi-turn serving through the HTTP API: TTFT of later turns with conversation reuse against the
same server with reuse disabled (--no-reuse), aggregate tokens/s, and p50/p99 request latency.

Each of N concurrent conversations sends T turns, one after another: turn 1 carries a long document
(--history tokens of stdlib-docstring prose), later turns a short question, each with the whole
history as the OpenAI API requires. Replies are greedy with a fixed length (ignore_eos). The server
is `turnkv serve` in a subprocess; TTFT is the time to the first SSE chunk (the server sends its
first chunk once the first token is sampled).

CPU (the committed figures):
    python benchmarks/serving/serve_bench.py --out benchmarks/serving/results/serve_cpu
GPU, Llama-3.1-8B shape with random weights:
    python benchmarks/serving/serve_bench.py --model llama-3.1-8b --dtype bfloat16 --device cuda \
        --conversations 32 --history 16384 --max-tokens 64 --prefill-chunk 2048 --out benchmarks/serving/results/serve_gpu
(--tokenizer DIR gives the shape a tokenizer where the embedded GGUF is not installed.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

QUESTIONS = ["Summarise the document in one sentence.", "What is its main topic?",
             "Name one detail it mentions.", "What would you ask its author?", "Give it a title."]


def history_text(tokenizer, n_tokens: int, offset: int) -> str:
    """About n_tokens of prose, different for each conversation (a different start in the corpus)."""
    from turnkv.bench.datasets.filler import corpus

    paragraphs = corpus()
    out, i, count = [], offset * 7, 0
    while count < n_tokens + 16:  # paragraphs are counted one at a time (re-encoding the whole text is quadratic)
        out.append(paragraphs[i % len(paragraphs)])
        count += len(tokenizer.encode(" " + out[-1], add_special_tokens=False))
        i += 1
    ids = tokenizer.encode(" ".join(out), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, reuse: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "turnkv.cli", "serve", "--port", str(port), "--served-model-name", "bench",
           "--max-running", str(args.conversations), "--max-waiting", str(args.conversations),
           "--prefill-chunk", str(args.prefill_chunk), "--log-level", "warning"]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--kv-memory", args.kv_memory), ("--recipe", args.recipe), ("--tokenizer", args.tokenizer)):
        if value is not None:
            cmd += [flag, value]
    if not reuse:
        cmd.append("--no-reuse")
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                print(f"server up in {time.monotonic() - deadline + 600:.1f} s", flush=True)
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


async def one_turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
    end = time.perf_counter()
    return {"ttft_s": first - start, "latency_s": end - start, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": usage["completion_tokens"]}


async def conversation(client, url, document: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": "You answer questions about documents."},
                {"role": "user", "content": f"{document}\n\n{QUESTIONS[0]}"}]
    out = []
    for t in range(turns):
        result = await one_turn(client, url, messages, max_tokens)
        result["turn"] = t + 1
        out.append(result)
        messages += [{"role": "assistant", "content": result["text"]},
                     {"role": "user", "content": QUESTIONS[(t + 1) % len(QUESTIONS)]}]
    return out


async def workload(url: str, documents: list[str], turns: int, max_tokens: int) -> tuple[list[list[dict]], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as client:
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, url, d, turns, max_tokens) for d in documents))
        return convs, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def summarise(convs: list[list[dict]], wall_s: float) -> dict:
    requests = [r for conv in convs for r in conv]
    later = [r for r in requests if r["turn"] > 1]
    return {
        "wall_s": wall_s,
        "requests": len(requests),
        "ttft_turn1_mean_s": statistics.mean(r["ttft_s"] for r in requests if r["turn"] == 1),
        "ttft_later_mean_s": statistics.mean(r["ttft_s"] for r in later),
        "ttft_later_p50_s": percentile([r["ttft_s"] for r in later], 50),
        "ttft_later_p99_s": percentile([r["ttft_s"] for r in later], 99),
        "ttft_by_turn_mean_s": {t: statistics.mean(r["ttft_s"] for r in requests if r["turn"] == t)
                                for t in sorted({r["turn"] for r in requests})},
        "latency_p50_s": percentile([r["latency_s"] for r in requests], 50),
        "latency_p99_s": percentile([r["latency_s"] for r in requests], 99),
        "generated_tokens": sum(r["completion_tokens"] for r in requests),
        "tokens_per_s": sum(r["completion_tokens"] for r in requests) / wall_s,
        "prompt_tokens_later_mean": statistics.mean(r["prompt_tokens"] for r in later),
        "cached_tokens_later_mean": statistics.mean(r["cached_tokens"] for r in later),
    }


def report(args, results: dict) -> str:
    reuse, base = results.get("reuse"), results.get("no_reuse")
    lines = [f"# Serving: {args.conversations} concurrent {args.turns}-turn conversations over HTTP", "",
             f"Command: `python benchmarks/serving/serve_bench.py {' '.join(sys.argv[1:])}`", "",
             f"Model: {args.model or 'SmolLM2-135M-Instruct (embedded GGUF)'}, device {args.device or 'default'}, "
             f"dtype {args.dtype or 'default'}; history {args.history} tokens in turn 1, {args.max_tokens} greedy "
             f"tokens per reply (ignore_eos), prefill slices of {args.prefill_chunk} tokens. "
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads as the server sets them.", "",
             "| | reuse (default) | --no-reuse |", "|---|---|---|"]

    def row(name, key, fmt="{:.3f}"):
        cells = [fmt.format(r[key]) if r else "-" for r in (reuse, base)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")

    row("TTFT turn 1, mean (s)", "ttft_turn1_mean_s")
    later = f"turns 2-{args.turns}"
    row(f"TTFT {later}, mean (s)", "ttft_later_mean_s")
    row(f"TTFT {later}, p50 (s)", "ttft_later_p50_s")
    row(f"TTFT {later}, p99 (s)", "ttft_later_p99_s")
    row("prompt tokens per later turn, mean", "prompt_tokens_later_mean", "{:.0f}")
    row("of which cached (reused), mean", "cached_tokens_later_mean", "{:.0f}")
    row("request latency p50 (s)", "latency_p50_s")
    row("request latency p99 (s)", "latency_p99_s")
    row("aggregate generated tokens/s", "tokens_per_s", "{:.1f}")
    row("wall time (s)", "wall_s", "{:.1f}")
    if reuse and base:
        lines += ["", f"TTFT of turns 2-{args.turns}: **{base['ttft_later_mean_s'] / reuse['ttft_later_mean_s']:.1f}x "
                  f"lower with reuse** (mean), {base['ttft_later_p50_s'] / reuse['ttft_later_p50_s']:.1f}x at p50; "
                  f"aggregate tokens/s {reuse['tokens_per_s'] / base['tokens_per_s']:.2f}x."]
    return "\n".join(lines) + "\n"


def conversation_args(p: argparse.ArgumentParser, turns: int) -> None:
    """The engine and the conversation shape, as the serving benchmarks share them."""
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--kv-memory", default=None)
    p.add_argument("--recipe", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or GGUF (default: the embedded SmolLM2's)")
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--history", type=int, default=2048, help="tokens of the document in turn 1")
    p.add_argument("--max-tokens", type=int, default=16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    conversation_args(p, turns=4)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--modes", default="reuse,no_reuse")
    p.add_argument("--out", default=None, help="path stem for .json and .md results")
    args = p.parse_args()

    from turnkv.engine.llm import _load_tokenizer

    tokenizer = _load_tokenizer(args.tokenizer)  # shapes borrow the embedded model's unless told otherwise
    documents = [history_text(tokenizer, args.history, i) for i in range(args.conversations)]
    results = {}
    for mode in args.modes.split(","):
        proc, url = start_server(args, reuse=(mode == "reuse"))
        try:
            convs, wall = asyncio.run(workload(url, documents, args.turns, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(120)
        results[mode] = summarise(convs, wall)
        results[mode]["replies"] = [[r["text"] for r in conv] for conv in convs]
        print(mode, json.dumps({k: v for k, v in results[mode].items() if k != "replies"}, indent=1), flush=True)
    if "reuse" in results and "no_reuse" in results:
        # Same greedy replies with and without reuse, or the comparison is not like for like.
        same = sum(a == b for ca, cb in zip(results["reuse"]["replies"], results["no_reuse"]["replies"])
                   for a, b in zip(ca, cb))
        results["identical_replies"] = f"{same}/{args.conversations * args.turns}"
    text = report(args, results)
    if "identical_replies" in results:
        text += f"\nReplies identical between the two servers: {results['identical_replies']}.\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
