"""Where a graphed decode step's time goes, per kernel: dense and LServe (streaming heads with a random
pattern) at one long context, Llama-3.1-8B shape with random weights in bf16, batch 1. One prefill
serves both (dense first; LServe's start then trims its streaming heads). For each recipe: wall ms
per step over 48 steps, then 16 steps under torch.profiler: GPU time per step of each kernel name,
the kernels' sum, and the rest of the wall time (gaps between kernels). JSON to $OUT/step_profile.json.

    python benchmarks/sparse/gpu_step_profile.py [--context 129536]     # H100: ~1.5 min

--splits / --block-n / --warps override the launch of the decode over a selection's lists (the
chunks per row, keys per tile, warps) for a launch sweep (gpu_selection_launch.py runs one process
per setting: a CUDA graph captures the setting it was made with).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_decode_selection as S  # noqa: E402

import turnkv  # noqa: E402
from turnkv.attention import decode  # noqa: E402
from turnkv.attention.triton import decode as decode_kernel  # noqa: E402
from turnkv.kv.sequence import SequenceKV  # noqa: E402
from turnkv.methods.recipe import Recipe  # noqa: E402


def profile_recipe(llm, seq, name: str, recipe: Recipe, ctx: int, steps: int = 48, profiled: int = 16) -> dict:
    states = S.start(llm, recipe, [seq], ctx)
    tok = torch.full((1,), 7, device=llm.device)
    tok, _ = S.decode_steps(llm, recipe, [seq], states, tok, 8)  # captures, first selections
    torch.cuda.synchronize()
    begin = time.perf_counter()
    tok, _ = S.decode_steps(llm, recipe, [seq], states, tok, steps)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - begin) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        S.decode_steps(llm, recipe, [seq], states, tok, profiled)
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    launches = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name[:60]] += (e.time_range.end - e.time_range.start) / profiled
            launches[e.name[:60]] += 1 / profiled
    kernels_us = sum(per_kernel.values())
    row = {"recipe": name, "context": ctx, "wall_us_per_step": wall_us, "kernels_us_per_step": kernels_us,
           "gaps_us_per_step": wall_us - kernels_us,
           "kernels": [{"name": k, "us_per_step": v, "launches_per_step": launches[k]}
                       for k, v in per_kernel.most_common()]}
    print(f"\n{name} at {ctx}: wall {wall_us:.0f} us/step, kernels {kernels_us:.0f}, gaps {wall_us - kernels_us:.0f}")
    for k in row["kernels"][:14]:
        print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['name']}")
    return row


def override_launch(splits: int | None, block_n: int | None, warps: int | None) -> None:
    """Launch settings for the decode over selected lists, set before any graph is captured."""
    if block_n is not None:
        decode_kernel.DEFAULT_CONFIG["block_n"] = block_n
    if warps is not None:
        decode_kernel.DEFAULT_CONFIG["num_warps"] = warps
    if splits is not None:
        chosen = decode.num_splits

        def num_splits(device, batch_kv_heads, max_length, kv_dtype=None, selected=False):
            return splits if selected else chosen(device, batch_kv_heads, max_length, kv_dtype)

        decode.num_splits = num_splits


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=129536)
    p.add_argument("--recipes", default="dense,lserve")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/sparse/results")
    p.add_argument("--splits", type=int, default=None, help="chunks per row of the selection's lists")
    p.add_argument("--block-n", type=int, default=None, help="keys per tile of the decode kernel")
    p.add_argument("--warps", type=int, default=None, help="warps of the decode kernel")
    args = p.parse_args()
    override_launch(args.splits, args.block_n, args.warps)
    ctx = args.context
    llm = turnkv.LLM("llama-3.1-8b", dtype="bfloat16", device="cuda", kv_memory=int(ctx * 131072 * 1.1) + (1 << 30),
                     max_model_len=131072)
    seq = SequenceKV(llm.pool)
    llm.runner.prefill(seq, S.prompt(ctx, llm.config.vocab_size, ctx))
    rows = [profile_recipe(llm, seq, name, Recipe.parse(S.RECIPES[name]), ctx) for name in args.recipes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump({"command": "python benchmarks/sparse/gpu_step_profile.py " + " ".join(sys.argv[1:]),
                   "device": torch.cuda.get_device_name(), "launch": {"splits": args.splits, "block_n": args.block_n,
                                                                     "warps": args.warps}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
