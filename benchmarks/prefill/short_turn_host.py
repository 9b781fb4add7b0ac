"""Whether a short later turn is bound by the host or by the GPU: Llama-3.1-8B shape with random
weights in bf16, batch 1, through the engine's runner (the prefill LLM.generate and Conversation.send
take), heap frozen as the CLI freezes it. For each kept history and turn size:
- wall: the prefill's time, synchronised before and after (median of 8, each rolled back after);
- host issue: the time until the prefill returns without waiting for the GPU (its launches);
- GPU kernels: the sum of its kernels' times under torch.profiler, and how many kernels it ran.
A turn whose host issue is about its wall and well above its GPU kernels waits on the host.
Each cell runs twice in the same process: eagerly (the prefill graphs off) and replayed from the
prefill's CUDA graphs (engine/graph_prefill.py; the first call captures, the median leaves it out).

    python benchmarks/prefill/short_turn_host.py --out benchmarks/prefill/results/h100_short_turn_host.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import turnkv  # noqa: E402
from turnkv import heap  # noqa: E402
from turnkv.kv.sequence import SequenceKV  # noqa: E402


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--histories", default="1000,8192")
    p.add_argument("--turns", default="16,64,512")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    llm = turnkv.LLM("llama-3.1-8b", dtype="bfloat16", device="cuda", max_model_len=16384, kv_memory="8GiB")
    heap.freeze()
    runner, rows = llm.runner, []
    graphs = runner.prefill_graphs
    for history_len in map(int, args.histories.split(",")):
        history = SequenceKV(llm.pool)
        runner.prefill(history, prompt(history_len, 0))
        for T, mode in [(T, mode) for T in map(int, args.turns.split(",")) for mode in ("eager", "graphed")]:
            runner.prefill_graphs = graphs if mode == "graphed" else None
            turn = prompt(T, 1)
            walls = []
            for _ in range(8):
                torch.cuda.synchronize()
                start = time.perf_counter()
                runner.prefill(history, turn)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - start) * 1e3)
                history.truncate(history_len)
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner.prefill(history, turn)
            issue = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            history.truncate(history_len)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.prefill(history, turn)
                torch.cuda.synchronize()
            history.truncate(history_len)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            gpu = sum((e.time_range.end - e.time_range.start) / 1e3 for e in kernels)
            rows.append(dict(history=history_len, new_tokens=T, mode=mode, wall_ms=sorted(walls)[len(walls) // 2],
                             wall_min_ms=min(walls), host_issue_ms=issue, gpu_kernels_ms=gpu, kernels=len(kernels)))
            r = rows[-1]
            print(f"history {history_len} turn {T} {mode}: wall {r['wall_ms']:.2f} ms (min {r['wall_min_ms']:.2f}), "
                  f"host issue {issue:.2f} ms, GPU kernels {gpu:.2f} ms in {len(kernels)} kernels", flush=True)
        history.free()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
