"""Where a short later turn's time goes on the library's path, `conv.send`.

One conversation as serve_bench.py and ttft_breakdown.py run it (a --history-token document, then
short questions, greedy replies of --max-tokens), through `conv.send`. For each later turn: the new
tokens, TTFT, and the time of the first-token part alone (`max_new_tokens=1` on a copy of the turn,
rolled back). The last --profiled turns run under torch.profiler (kernels on the GPU against wall
time; the host's busiest operations) and cProfile (the Python functions with the most own time).

    python benchmarks/serving/turn_profile.py --model llama-3.1-8b --dtype bfloat16 --device cuda \
        --history 8192 --turns 10 --max-tokens 32 --out results/turn-profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import QUESTIONS, conversation_args, history_text  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    conversation_args(p, turns=8)
    p.add_argument("--profiled", type=int, default=2, help="the last N turns run under the profilers")
    p.add_argument("--out", default=None, help="path stem for the .md report")
    args = p.parse_args()

    from turnkv import heap
    from turnkv.engine.llm import LLM, _load_tokenizer

    llm = LLM(args.model, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer, kv_memory=args.kv_memory,
              recipe=args.recipe)
    heap.freeze()
    cuda = llm.device.type == "cuda"
    document = history_text(_load_tokenizer(args.tokenizer), args.history, 0)
    conv = llm.conversation(system="You answer questions about documents.")
    lines = [f"# A later turn through conv.send: {args.history}-token document, {args.turns} turns", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             "| turn | new tokens | reused | TTFT (ms) | send() wall (ms) |", "|---|---|---|---|---|"]
    sampling = {"max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    report = []
    for t in range(args.turns):
        text = f"{document}\n\n{QUESTIONS[0]}" if t == 0 else QUESTIONS[t % len(QUESTIONS)]
        profiled = t >= args.turns - args.profiled
        prof = cprof = None
        if profiled:
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
            cprof = cProfile.Profile()
            cprof.enable()
        start = time.perf_counter()
        reply = conv.send(text, **sampling)
        wall = time.perf_counter() - start
        if profiled:
            cprof.disable()
            prof.__exit__(None, None, None)
            report += profile_report(t + 1, prof, cprof, reply, cuda)
        lines.append(f"| {t + 1} | {reply.prompt_tokens} | {reply.cached_tokens} | {reply.ttft_s * 1000:.1f} | "
                     f"{wall * 1000:.1f} |")
    later = [float(x.split("|")[4]) for x in lines[6 + 1 : 6 + args.turns - args.profiled]]
    if later:
        lines += ["", f"TTFT median over turns 2 to {args.turns - args.profiled}: {statistics.median(later):.1f} ms"]
    text = "\n".join(lines + [""] + report) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".md").write_text(text)


def profile_report(turn: int, prof, cprof, reply, cuda: bool) -> list[str]:
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = [e for e in events if e.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                 "cudaLaunchKernelExC", "cuLaunchKernelEx")]
    out = [f"## Turn {turn} under the profilers (TTFT {reply.ttft_s * 1000:.1f} ms, {reply.prompt_tokens} new tokens)",
           ""]
    if cuda:
        graph = sum(e.name == "cudaGraphLaunch" for e in launches)
        out += [(f"- GPU kernels: {len(kernels)}, {sum(e.device_time for e in kernels) / 1000:.1f} ms in all; "
                 f"launches from the host: {len(launches)} ({graph} graph replays)"), ""]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    s = io.StringIO()
    pstats.Stats(cprof, stream=s).sort_stats("tottime").print_stats(25)
    return out + ["Host operations, by own CPU time:", "```", table, "```", "",
                  "Python functions, by own time (the whole send(), decode included):", "```", s.getvalue(), "```", ""]


if __name__ == "__main__":
    main()
