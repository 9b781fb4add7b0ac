"""Tensor parallelism on GPUs: N=2 (or --tensor-parallel N) against N=1, and what decode costs.

(a) A random-weight model of the given shape (default llama-3.1-8b) in fp32: a system prompt of
--prompt-tokens tokens and three user turns per recipe, at N=1 and at N; prints whether the greedy
tokens and the kept (layer, KV head, positions) sets agree. (b) At N, in --timing-dtype: decode's time
per token with and without CUDA graphs, and one all-reduce of one token's hidden state, eager and
replayed from a CUDA graph, times the all-reduces of a step. Writes everything to --out (JSON).
Exit status 1 when a recipe's tokens or kept sets differ.

    python benchmarks/parallel/check_gpu.py --out check_gpu.json
    python benchmarks/parallel/check_gpu.py --prompt-tokens 1024 --recipes full,snapkv --skip-timing
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Decode selections with budgets below the prompt, so that they select.
DEFAULT_RECIPES = ("full,snapkv keep_ratio=0.25,ada-snapkv keep_ratio=0.25,lserve-random decode=lserve(budget=1024),"
                   "quest decode=quest(budget=1024),snapkv keep_ratio=0.25 state=krul")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a shape name (random weights) or a model path")
    p.add_argument("--tokenizer", default=None, help="for a shape name: a tokenizer folder or GGUF file "
                                                    "(default: the embedded model's)")
    p.add_argument("--device", default="cuda", help="cuda (rank r on cuda:r), or cpu (gloo: the CI's tiny check)")
    p.add_argument("--dtype", default="float32", help="dtype of the token check")
    p.add_argument("--timing-dtype", default=None, help="dtype of the timings (default: the engine's, bfloat16 on CUDA)")
    p.add_argument("--tensor-parallel", type=int, default=2, help="N, compared with 1")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of the system prompt (and timing prompt)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per reply in the token check")
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated presets or recipe strings")
    p.add_argument("--kv-memory", default=None, help="each rank's KV pool (default: the engine's)")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed")
    p.add_argument("--all-reduce-iterations", type=int, default=200, help="all-reduces per timing")
    p.add_argument("--skip-tokens", action="store_true", help="leave out the token check (a)")
    p.add_argument("--skip-timing", action="store_true", help="leave out the timings (b)")
    p.add_argument("--out", default="check_gpu.json", help="JSON of every figure and token")
    args = p.parse_args(argv)
    if args.tensor_parallel < 2:
        p.error("--tensor-parallel must be at least 2 (it is compared with 1)")
    if min(args.prompt_tokens, args.new_tokens, args.steps, args.all_reduce_iterations) < 1:
        p.error("--prompt-tokens, --new-tokens, --steps and --all-reduce-iterations must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from turnkv.bench import parallel_check
    from turnkv.bench.cli import _split

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tensor_parallel:
        print(f"needs {args.tensor_parallel} GPUs; torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    started = time.time()
    result = {"model": args.model, "tensor_parallel": args.tensor_parallel, "device": args.device,
              "gpus": [torch.cuda.get_device_name(i) for i in range(args.tensor_parallel)]
              if args.device.startswith("cuda") else [], "torch": torch.__version__, "settings": vars(args)}
    same = True
    if not args.skip_tokens:
        rows = parallel_check.check_tokens(args, _split(args.recipes))
        result["tokens"] = rows
        same = all(r["same_tokens"] and r["same_kept"] for r in rows)
        print(f"(a) N={args.tensor_parallel} against N=1, {args.dtype}, {args.model}, about {args.prompt_tokens}-token "
              f"system prompt, 3 turns of {args.new_tokens} tokens:")
        print(parallel_check.table(rows), flush=True)
    if not args.skip_timing:
        result["timing"] = parallel_check.time_decode(args)
        print("(b) " + parallel_check.timing_text(result["timing"]))
    result["wall_s"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out} ({result['wall_s']} s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
