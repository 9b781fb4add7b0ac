"""Where a compression's time goes: one conversation under a compressing recipe through
Conversation.send, a long document in turn 1 and short questions after it, with every eviction
(Eviction.compress) timed with the device synchronized, and the host profile of the first two.

    python benchmarks/serving/profile_compress.py --model llama-3.1-8b --dtype bfloat16 --device cuda \
        --recipe "ada-snapkv keep_ratio=0.1 schedule=prompt" --prompt 32768 --turns 4

A diagnostic: a serving step that ends a prompt runs its compression, and every running stream waits
for it (capacity_bench.py's timeline shows those gaps)."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import turnkv
from turnkv.methods.evict.eviction import Eviction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity_workload import document_text  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched under it (each one a kernel launch or more on a GPU, views
    aside) and the reads from a device back to the host (a synchronization each)."""

    def __init__(self):
        super().__init__()
        self.ops = self.reads_back = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and source.device.type != "cpu" and (
                func is torch.ops.aten._local_scalar_dense.default
                or (func is torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "cpu")
                or (func is torch.ops.aten.nonzero.default)):
            self.reads_back += 1
        return func(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", default=None, help="for a shape: default the embedded SmolLM2's")
    p.add_argument("--recipe", default="ada-snapkv keep_ratio=0.1 schedule=prompt")
    p.add_argument("--prompt", type=int, default=32768, help="tokens of turn 1's document")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory", default="16GiB")
    p.add_argument("--profiled", type=int, default=2, help="compressions to profile on the host")
    p.add_argument("--trace", action="store_true", help="also trace those compressions' device kernels (torch.profiler)")
    p.add_argument("--warmup", action="store_true",
                   help="play turn 1 once in a conversation of its own first (kernel loading, allocator growth)")
    p.add_argument("--count-ops", action="store_true",
                   help="count the torch operators each compression dispatches and, on a GPU, its reads back "
                        "to the host (the counting slows it: its times are not the plain ones)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    llm = turnkv.LLM(args.model, dtype=getattr(torch, args.dtype), device=args.device, kv_memory=args.kv_memory,
                     tokenizer=args.tokenizer,
                     recipe=args.recipe)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    calls, profiles = [], []
    compress = Eviction.compress

    def timed_compress(self, kv, *rest, **options):
        profile = cProfile.Profile() if len(profiles) < args.profiled else None
        tracer = None
        if profile and args.trace:
            activities = [torch.profiler.ProfilerActivity.CPU] + \
                ([torch.profiler.ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
            tracer = torch.profiler.profile(activities=activities)
            tracer.__enter__()
        sync()
        start = time.perf_counter()
        if profile:
            profile.enable()
        counter = OpCounter() if args.count_ops else contextlib.nullcontext()
        with counter:
            entry = compress(self, kv, *rest, **options)
        sync()
        seconds = time.perf_counter() - start
        if profile:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
            if tracer is not None:
                tracer.__exit__(None, None, None)
                key = "device_time_total" if llm.device.type == "cuda" else "cpu_time_total"
                text.write(tracer.key_averages().table(sort_by=key, row_limit=25))
            profiles.append(text.getvalue())
        calls.append({"seconds": seconds, "span": entry["span"], "kept_tokens": int(kv.lengths.sum()),
                      **({"ops": counter.ops, "reads_back": counter.reads_back} if args.count_ops else {})})
        return entry

    document = document_text(llm.tokenizer, args.prompt, 0) + "\n\nWhat is this about?"
    if args.warmup:
        warm = llm.conversation()
        warm.send(document, max_new_tokens=2)
        warm.close()
    Eviction.compress = timed_compress
    conv = llm.conversation()
    rows = []
    for turn in range(args.turns):
        text = document if turn == 0 else f"Question {turn}: and then?"
        before = len(calls)
        sync()
        start = time.perf_counter()
        reply = conv.send(text, max_new_tokens=args.max_tokens)
        sync()
        rows.append({"turn": turn + 1, "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
                     "send_s": time.perf_counter() - start, "compressions": calls[before:]})
    print("| turn | prompt tokens | cached | send (s) | compressions (ms) | kept tokens after |"
          + (" torch ops / reads back |" if args.count_ops else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.count_ops else ""))
    for row in rows:
        ms = ", ".join(f"{c['seconds'] * 1000:.1f}" for c in row["compressions"]) or "-"
        kept = row["compressions"][-1]["kept_tokens"] if row["compressions"] else "-"
        ops = ", ".join(f"{c.get('ops')} / {c.get('reads_back')}" for c in row["compressions"]) or "-"
        print(f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['send_s']:.3f} | {ms} "
              f"| {kept} |" + (f" {ops} |" if args.count_ops else ""))
    for i, text in enumerate(profiles):
        print(f"--- host profile: compression {i + 1} ---")
        print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"recipe": str(llm.recipe), "prompt": args.prompt, "turns": rows}, f, indent=1)


if __name__ == "__main__":
    main()
