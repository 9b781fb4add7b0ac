"""Where a prefill's GPU time goes, per kernel: Llama-3.1-8B shape with random weights in bf16, batch 1,
through the engine's runner (the path LLM.generate and Conversation.send take): a fresh 32K prompt,
a 128K prompt (four 32K slices, the later ones over the paged history), and a 512-token turn over
that 128K history. Each case runs once untimed, then once timed (wall), then once under
torch.profiler: GPU time of each kernel name, and the sums for matmuls, attention and the rest.
JSON to $OUT/prefill_profile.json. With --tensor-parallel N, every rank runs the cases together (as
the engine's ranks run any prefill) and each rank's profile is kept: collectives (NCCL kernels) are
counted apart from the rest.

    python benchmarks/prefill/gpu_prefill_profile.py     # H100: ~2 min
    python benchmarks/prefill/gpu_prefill_profile.py --tensor-parallel 2
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

sys.path.insert(0, ".")
import turnkv  # noqa: E402
from turnkv.kv.sequence import SequenceKV  # noqa: E402
from turnkv.parallel.mirror import gather  # noqa: E402

MATMUL = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "_skinny_matmul")
ATTENTION = ("flash", "fmha", "cudnn", "attention", "_chunk", "sdpa")
CONTEXT = 129536


def kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "collective"
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    return "other"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def case(label: str, make, run) -> dict:
    """make() -> a sequence state (with free()); run(state) prefills. Untimed, timed, then profiled."""
    for mode in ("warm", "timed", "profiled"):
        state = make()
        torch.cuda.synchronize()
        if mode == "profiled":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(state)
                torch.cuda.synchronize()
        else:
            begin = time.perf_counter()
            run(state)
            torch.cuda.synchronize()
            wall = time.perf_counter() - begin
        state.free()
    per_kernel = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3  # ms
    kinds = collections.Counter()
    for name, ms in per_kernel.items():
        kinds[kind(name)] += ms
    return {"case": label, "wall_ms": wall * 1e3, "kernels_ms": sum(per_kernel.values()), "by_kind_ms": dict(kinds),
            "kernels": [{"name": k, "ms": v} for k, v in per_kernel.most_common(20)]}


def kv_memory(config, dtype):
    """One 128K sequence and a turn (module-level: a tensor-parallel engine pickles it to its ranks)."""
    return int((CONTEXT + 2048) * config.kv_bytes_per_token(dtype.itemsize) * 1.1)


def profile_engine(engine) -> list[dict]:
    """The three cases on one engine (a rank's, under tensor parallelism: every rank runs them alike)."""
    runner = engine.runner
    long, turn = prompt(CONTEXT, 0), prompt(512, 1)
    rows = [case("32K prompt", lambda: SequenceKV(engine.pool), lambda seq: runner.prefill(seq, long[:32768])),
            case("128K prompt", lambda: SequenceKV(engine.pool), lambda seq: runner.prefill(seq, long))]
    history = SequenceKV(engine.pool)
    runner.prefill(history, long)

    class Turn:  # the 128K history, rolled back to its end after each turn
        def free(self):
            history.truncate(CONTEXT)

    rows.append(case("512-token turn over 128K", Turn, lambda _: runner.prefill(history, turn)))
    history.free()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args()
    llm = turnkv.LLM("llama-3.1-8b", dtype="bfloat16", device="cuda", max_model_len=131072, kv_memory=kv_memory,
                     tensor_parallel=args.tensor_parallel)
    ranks = gather(llm, profile_engine)
    for rank, rows in enumerate(ranks):
        for row in rows:
            print(f"\nrank {rank}, {row['case']}: wall {row['wall_ms']:.1f} ms; GPU: "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in row["by_kind_ms"].items()))
            for k in row["kernels"][:10]:
                print(f"  {k['ms']:9.2f} ms  {k['name']}")
    out = os.environ.get("OUT") or "benchmarks/prefill/results"
    os.makedirs(out, exist_ok=True)
    name = "prefill_profile.json" if args.tensor_parallel == 1 else f"prefill_profile_tp{args.tensor_parallel}.json"
    command = "python benchmarks/prefill/gpu_prefill_profile.py" + (
        f" --tensor-parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else "")
    with open(os.path.join(out, name), "w") as f:
        json.dump({"command": command, "device": torch.cuda.get_device_name(), "tensor_parallel": args.tensor_parallel,
                   "rows": ranks[0], "ranks": ranks}, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
