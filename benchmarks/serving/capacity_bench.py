"""Serving at capacity: how many long multi-turn conversations each KV recipe keeps on the GPU, and
what that does to throughput and latency, measured over HTTP against `turnkv serve`.

For each configuration the script starts `turnkv serve` in a subprocess and plays the same workload
(capacity_workload.py: N users, Poisson arrivals, a long document in turn 1, short questions after
think times, one seed) through the official `openai` client (capacity_client.py). Per configuration
it reports aggregate output tokens/s, TTFT p50/p99 per turn index, inter-token latency p50/p99 (and
while another user's turn 1 prefills), conversations on the GPU / in the CPU tier / dropped, KV bytes,
tier traffic in bytes and seconds, and prompt tokens reused against prefilled (the server's /metrics
and the responses' usage). It writes results.json, results.md and two plots into --out.

Configurations (--configs picks some, in order):
    full          the dense cache
    no-reuse      the dense cache, every request prefilled from scratch (--no-reuse: nothing from a kept
                  conversation nor from the prefix index; every cached_tokens is 0)
    ada-snapkv    ada-snapkv keep_ratio=0.1
    lserve        LServe (streaming heads at random: random weights have no calibrated head pattern)
    flowkv        FlowKV over SnapKV, keep_ratio=0.1
    full-krul     the dense cache; conversations leave the GPU after each turn in Krul's stored form,
                  packed on the server's background packer beside the running streams
    full-krul-inline  full-krul with --inline-packs: each pack inside the turn's end, on the worker
                  (what every running stream waited for before the background packer)
    full-sliced   full with --max-step-tokens 0: a prefill slice runs as its own forward between two
                  decode steps (the scheduler before mixed steps), for the inter-token comparison
    ada-snapkv-sliced  ada-snapkv with --max-step-tokens 0, the same comparison without tier traffic

CPU smoke run (embedded SmolLM2-135M, a few users, short documents):
    python benchmarks/serving/capacity_bench.py --smoke --out benchmarks/serving/results/capacity_cpu_smoke
H100 80GB, Llama-3.1-8B shape with random weights, SmolLM2's tokenizer rendering the chat template:
    python benchmarks/serving/capacity_bench.py --model llama-3.1-8b --dtype bfloat16 --device cuda \\
        --users 64 --turns 6 --doc-tokens 32768 --max-tokens 128 --kv-memory 56GiB --state-cpu-memory 100GiB \\
        --prefill-chunk 2048 --max-step-tokens 4096 --arrival-rate 0.5 --think-s 5 \\
        --out benchmarks/serving/results/capacity_h100
Tensor parallel (--tensor-parallel N: each configuration's server runs on N GPUs, --kv-memory per rank),
e.g. the Llama-3.1-70B shape over 32 users with 32K documents:
    python benchmarks/serving/capacity_bench.py --model llama-3.1-70b --tensor-parallel 4 --users 32 \\
        --doc-tokens 32768 --configs full,ada-snapkv --out benchmarks/serving/results/capacity_70b_tp4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import capacity_client  # noqa: E402
import capacity_report  # noqa: E402
from capacity_workload import make_users  # noqa: E402

CONFIGS = {
    "full": ["--recipe", "full"],
    "no-reuse": ["--recipe", "full", "--no-reuse"],
    # Compressed as soon as a turn's prompt is prefilled: the presets' question-aware schedule keeps the
    # running turn whole until the next question arrives, so between turns a conversation would hold its
    # 32K document. FlowKV keeps the running turn whole by design: it compresses at the turn's end.
    "ada-snapkv": ["--recipe", "ada-snapkv keep_ratio=0.1 schedule=prompt"],
    "lserve": ["--recipe", "lserve-random"],
    "flowkv": ["--recipe", "flowkv keep_ratio=0.1 schedule=turn_end"],
    "full-krul": ["--recipe", "state=krul"],
    "full-krul-inline": ["--recipe", "state=krul", "--inline-packs"],
    "full-sliced": ["--recipe", "full", "--max-step-tokens", "0"],
    "ada-snapkv-sliced": ["--recipe", "ada-snapkv keep_ratio=0.1 schedule=prompt", "--max-step-tokens", "0"],
}
SMOKE = {"model": None, "dtype": "float32", "device": "cpu", "users": 4, "turns": "3-4", "doc_tokens": 320,
         "max_tokens": 8, "kv_memory": "64MiB", "state_cpu_memory": "256MiB", "prefill_chunk": 64,
         "max_step_tokens": 256, "arrival_rate": 1.0, "think_s": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args, config: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "turnkv.cli", "serve", "--port", str(port), "--served-model-name", "bench",
           "--max-running", str(args.max_running or 2 * args.users), "--max-waiting", str(2 * args.users),
           "--prefill-chunk", str(args.prefill_chunk), "--max-step-tokens", str(args.max_step_tokens),
           "--max-tokens", str(args.max_tokens), "--log-level", "warning"]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--kv-memory", args.kv_memory), ("--state-cpu-memory", args.state_cpu_memory),
                        ("--tokenizer", args.tokenizer)):
        if value is not None:
            cmd += [flag, value]
    if args.tensor_parallel > 1:
        cmd += ["--tensor-parallel", str(args.tensor_parallel)]
    return cmd + CONFIGS[config]  # a later --max-step-tokens wins


def start_server(cmd: list[str], port: int, log_path: Path, timeout_s: float = 1200) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start; its log: {log_path}")
        time.sleep(0.5)


def run_config(args, config: str, users, out: Path) -> dict:
    port = free_port()
    cmd = server_command(args, config, port)
    proc = start_server(cmd, port, out / f"server_{config}.log")
    try:
        records, wall, samples, lags = asyncio.run(capacity_client.run(
            f"http://127.0.0.1:{port}", users, args.max_tokens, deadline_s=args.deadline_s, cut_s=args.cut_s))
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary = capacity_report.summarise(records, wall, samples)
    summary["server_command"] = cmd[1:]
    summary["replies"] = {f"{r['user']}.{r['turn']}": r.get("text") for r in records}
    summary["client_loop_stalls"] = {"count": len(lags), "longest_s": max((late for _, late in lags), default=0.0)}
    summary["timeline"] = {**capacity_report.timeline(records), "client_loop_lags": lags}
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: " + json.dumps(SMOKE))
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("--model", default="llama-3.1-8b", help="a shape name (random weights), GGUF or folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", default=None, help="for a shape: default the embedded SmolLM2's")
    p.add_argument("--kv-memory", default=None, help="per rank under --tensor-parallel")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="serve each configuration on N devices (turnkv serve --tensor-parallel N)")
    p.add_argument("--state-cpu-memory", default="64GiB")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", default="6", help="turns per user: N or LO-HI (drawn per user)")
    p.add_argument("--doc-tokens", type=int, default=32768, help="tokens of the document in turn 1")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per reply (ignore_eos)")
    p.add_argument("--arrival-rate", type=float, default=0.5, help="users arriving per second (Poisson)")
    p.add_argument("--think-s", type=float, default=5.0, help="mean think time between a reply and the next turn")
    p.add_argument("--max-running", type=int, default=None, help="the server's ceiling (default 2 x users)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--max-step-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no turn after this many seconds (turns left are reported as unplayed)")
    p.add_argument("--cut-s", type=float, default=None,
                   help="cancel the turns still running after this many seconds (reported as unfinished), so "
                        "that a run ends and writes its figures within a time limit")
    p.add_argument("--out", required=True, help="a folder for results.json, results.md, plots and server logs")
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)

    from turnkv.engine.llm import _load_tokenizer
    from turnkv.model.load import embedded_model_path

    tokenizer = _load_tokenizer(args.tokenizer or (args.model if args.model and args.model.endswith(".gguf")
                                                   else None))
    users = make_users(tokenizer, args.users, args.doc_tokens, args.turns, args.arrival_rate, args.think_s, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"command": "python benchmarks/serving/capacity_bench.py " + " ".join(sys.argv[1:]), "args": vars(args),
              "model": args.model or str(embedded_model_path()), "machine": platform.machine(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "workload": {"users": len(users), "turns": [u.turns for u in users],
                           "arrivals_s": [round(u.arrival_s, 3) for u in users]}}
    results = {}
    for config in args.configs.split(","):
        print(f"== {config}", flush=True)
        results[config] = run_config(args, config, users, out)
        shown = {k: v for k, v in results[config].items() if k not in ("replies", "server_command")}
        print(json.dumps(shown, indent=1), flush=True)
        (out / "results.json").write_text(json.dumps({**header, "results": results}, indent=1))
    text = (f"# Serving at capacity\n\nCommand: `{header['command']}`\n\n{header['date']}, {header['machine']}, "
            f"{header['cpus']} CPUs. Model {header['model']}, {args.dtype} on {args.device}; {len(users)} users, "
            f"turns {args.turns}, {args.doc_tokens}-token documents in turn 1, {args.max_tokens} greedy tokens "
            f"per reply, arrivals {args.arrival_rate}/s, think time {args.think_s} s (mean), seed {args.seed}.\n\n"
            + capacity_report.table(results))
    (out / "results.md").write_text(text)
    capacity_report.plot(results, str(out / "capacity"))
    print(text)


if __name__ == "__main__":
    main()
