"""Where a streaming-heads prompt's time goes, against the full cache's, on the product's path
(LLM.generate): torch.profiler's top kernels and host functions for one prompt of each recipe.

    python benchmarks/prefill/lserve_profile.py --context 32768 --out OUT_DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from turnkv import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--recipes", default="full,lserve-random")
    parser.add_argument("--kv-memory", default="40GiB")
    parser.add_argument("--out", default="benchmarks/prefill/results/lserve-profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, dtype=torch.bfloat16, device="cuda", kv_memory=args.kv_memory)
    prompt = torch.randint(0, 32000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    for recipe in args.recipes.split(","):
        llm.generate(prompt[: args.context - 7], recipe=recipe, max_new_tokens=2, ignore_eos=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt[: args.context - 3], recipe=recipe, max_new_tokens=1, ignore_eos=True)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt[: args.context - 1], recipe=recipe, max_new_tokens=1, ignore_eos=True)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70)
        # The host's Python functions (torch's profiler sees only its own ops): the engine's own work
        # between and around the kernels.
        host = cProfile.Profile()
        host.enable()
        llm.generate(prompt[: args.context - 5], recipe=recipe, max_new_tokens=1, ignore_eos=True)
        torch.cuda.synchronize()
        host.disable()
        stream = io.StringIO()
        pstats.Stats(host, stream=stream).sort_stats("tottime").print_stats(30)
        text = (f"# {recipe} at {args.context}: {plain * 1e3:.1f} ms unprofiled\n\n{table}\n\n{cpu}\n\n"
                f"# host functions by own time\n{stream.getvalue()}\n")
        (out / f"{recipe}.txt").write_text(text)
        print(text[:6000])


if __name__ == "__main__":
    main()
