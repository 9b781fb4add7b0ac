"""One scoreboard: each system's headline cells, measured on one engine built once, in one process, beside
the full cache's figures from the same run and each paper's claim. Writes --out (JSON) and the same path
with .md (the table); the JSON is rewritten after every measurement, so a run stopped part-way keeps
what it measured.

H100, Llama-3.1-8B shape with random weights, bf16 (sized for under ten minutes):
    python benchmarks/scoreboard/scoreboard.py --model llama-3.1-8b --device cuda \\
        --out benchmarks/scoreboard/results/h100.json
CPU smoke run (the SmolLM2-135M shape with random weights; it checks the command, not the systems):
    OMP_NUM_THREADS=1 python benchmarks/scoreboard/scoreboard.py --model smollm2-135m --device cpu --contexts 256,512 \\
        --krul-history 512 --turn-tokens 64 --new-tokens 24 --repeat 1 --out /tmp/scoreboard.json
The table of a committed JSON, printed, or put into a page between its marker lines:
    python benchmarks/scoreboard/scoreboard.py --markdown benchmarks/scoreboard/results/h100.json \\
        [--page docs/benchmarks.md]

Cells (--cells picks systems): LServe's prefill TTFT at every --contexts, a --turn-tokens later turn over
the longest context kept, and decode at the longest; LoopServe's prefill (loopserve-p, loopserve) and
loopserve-d's decode at the longest; Ada-SnapKV's (keep 0.1) decode and KV at the longest; Krul's
restore of a --krul-history conversation from the CPU tier against recomputing it and against the full
cache's own offload and restore; FlowKV's agreement, read from the committed quality run. A cell needing
a chat template (the later turn, Krul) is left out, with the reason, on an engine without a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import score_cells as cells  # noqa: E402
import score_measure as measure  # noqa: E402
import score_table as table  # noqa: E402

import torch  # noqa: E402

from turnkv import heap  # noqa: E402
from turnkv.bench.speed import SpeedConfig, measure_hardware, pool_bytes  # noqa: E402
from turnkv.engine.llm import LLM  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="a model file or folder, or a shape such as llama-3.1-8b")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder or GGUF file whose chat template the later "
                   "turn and Krul's conversation use (default: the model's; a random-weight shape borrows the "
                   "embedded model's when it is installed)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--contexts", default="32768,129536", help="prompt lengths of the prefill cells; the longest "
                   "also gives the decode cells and the later turn's history")
    p.add_argument("--cells", default=",".join(cells.SYSTEMS), help="systems to score, comma-separated")
    p.add_argument("--turn-tokens", type=int, default=512, help="tokens of LServe's later turn")
    p.add_argument("--krul-history", type=int, default=32768, help="tokens of the conversation Krul restores")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens decoded per speed row (the first 16 steps left out of the time per token)")
    p.add_argument("--repeat", type=int, default=2, help="runs per figure (the median is kept; Krul's: the best)")
    p.add_argument("--kv-memory", default=None, help="KV pool size (default: what the longest row needs)")
    p.add_argument("--state-cpu-memory", default=None, help="CPU tier for Krul (default: 8GiB on CUDA, 1GiB on CPU)")
    p.add_argument("--out", default="benchmarks/scoreboard/results/latest.json")
    p.add_argument("--markdown", metavar="JSON", help="print the table of a scoreboard JSON and run nothing")
    p.add_argument("--page", help="with --markdown: put the table into this page between its marker lines")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.systems = [s.strip() for s in args.cells.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(cells.SYSTEMS))
    if unknown or not args.systems:
        p.error(f"--cells takes some of {','.join(cells.SYSTEMS)}; got {args.cells!r}")
    try:
        args.context_list = sorted({int(c) for c in args.contexts.split(",")})
    except ValueError:
        args.context_list = []
    if not args.context_list or min(args.context_list) < 16:
        p.error(f"--contexts takes comma-separated prompt lengths of at least 16 tokens; got {args.contexts!r}")
    if args.repeat < 1 or args.turn_tokens < 16 or args.krul_history < 256 or args.new_tokens < 1:
        p.error("--repeat >= 1, --turn-tokens >= 16, --krul-history >= 256 and --new-tokens >= 1")
    return args


def _code() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True,
                           text=True, check=False).stdout.strip()
    return (run.stdout.strip() or "unknown") + (" with local changes" if dirty else "")


def build_engine(args) -> LLM:
    """The one engine every cell runs on: its pool holds the longest prompt with its decode and later
    turns, or Krul's conversation, whichever is larger (a finished row's pages go back to the pool)."""
    longest = max(args.context_list)
    tokens = max(longest + args.new_tokens + (measure.WARMUP_TURNS + args.repeat + 1) * (args.turn_tokens + 64),
                 args.krul_history + 1024)

    def kv_memory(config, dtype):
        return pool_bytes(config, dtype, None, tokens)

    cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    return LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory or kv_memory,
               max_model_len=tokens, tokenizer=args.tokenizer,
               state_cpu_memory=args.state_cpu_memory or ("8GiB" if cuda else "1GiB"))


def run(args) -> dict:
    started = time.time()
    llm = build_engine(args)
    heap.freeze()  # no full collection of the engine's objects inside a timed step
    chat = getattr(llm.tokenizer, "chat_template", None) is not None
    messages = measure.Messages(llm) if chat else None
    later = messages.later if messages else 0
    settings = cells.Settings(tuple(args.context_list), args.turn_tokens,
                              measure.later_turn_history(llm.max_model_len, max(args.context_list), args.turn_tokens,
                                                         args.repeat, later),
                              args.krul_history)
    cfg = SpeedConfig(contexts=list(settings.contexts), new_tokens=args.new_tokens, turns=0, repeat=args.repeat,
                      peers=())
    hw = measure_hardware(llm)
    result = {"command": "python benchmarks/scoreboard/scoreboard.py " + " ".join(shlex.quote(a) for a in args.argv),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), "code": _code(),
              "model": llm.name, "weights": llm.source, "device": str(llm.device),
              "dtype": str(llm.dtype).removeprefix("torch."),
              "hardware": hw, "settings": {**vars(settings), "long": settings.long, "new_tokens": args.new_tokens,
                                           "repeat": args.repeat, "cells": args.systems},
              "claims": cells.claims(args.systems), "measurements": {}, "skipped": {}, "cells": [], "wall_s": 0.0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        result["cells"] = cells.cells(result["measurements"], args.systems, settings)
        result["wall_s"] = time.time() - started
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(table.markdown(result))

    for kind, spec, size in cells.plan(args.systems, settings):
        t, key = time.time(), cells.key(kind, spec, size)
        if kind == "speed":
            row = measure.speed(llm, spec, size, cfg, hw)
        elif messages is None:
            result["skipped"][key] = "the engine has no tokenizer with a chat template"
            continue
        elif kind == "turn":
            row = measure.later_turn(llm, spec, size, args.turn_tokens, args.repeat, messages)
        else:
            row = measure.restore(llm, size, spec, args.repeat, messages)
        result["measurements"][key] = row
        print(f"[{time.time() - started:6.1f} s] {key}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
        write()
    write()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.markdown:
        text = table.markdown(json.loads(Path(args.markdown).read_text()))
        if args.page:
            table.put_in_page(Path(args.page), args.markdown, text)
        print(text, end="")
        return 0
    result = run(args)
    print(table.markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
