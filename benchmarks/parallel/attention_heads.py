"""Prefill attention time per rank against the KV heads it holds: the 8B shape's 32K-token chunks at 128K
(the fresh causal chunk, then three chunks over 32K, 64K and 96K kept), at 8 KV heads (N=1) and 4 (N=2),
on one GPU. Ideal tensor-parallel scaling halves the time with the heads.

    python benchmarks/parallel/attention_heads.py --out attention_heads.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_timing import time_cuda  # noqa: E402
from turnkv.attention import chunk  # noqa: E402


def timed(fn, repeat: int) -> float:
    """Milliseconds per call: one untimed call, then `repeat` back to back between one pair of events."""
    return time_cuda(fn, repeat, warmup=1, back_to_back=True) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=32768)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--heads", default="8,4", help="KV heads per rank, comma-separated")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, dtype, D, T = torch.device("cuda"), torch.bfloat16, 128, args.chunk
    rows = []
    for H in (int(h) for h in args.heads.split(",")):
        Hq = H * args.group
        q = torch.randn(1, Hq, T, D, device=dev, dtype=dtype)
        k_new, v_new = (torch.randn(1, H, T, D, device=dev, dtype=dtype) for _ in range(2))
        total = 0.0
        for i in range(args.chunks):
            S = i * T
            if S == 0:
                ms = timed(lambda: chunk.fresh_causal(q, k_new, v_new), args.repeat)
            else:
                k_hist, v_hist = (torch.randn(1, H, S, D, device=dev, dtype=dtype) for _ in range(2))
                ms = timed(lambda: chunk.split_history(q, k_hist, v_hist, k_new, v_new), args.repeat)
                del k_hist, v_hist
            flops = 4 * Hq * D * T * (S + T / 2)
            rows.append({"kv_heads": H, "history": S, "ms": ms, "tflops": flops / ms / 1e9})
            total += ms
            print(f"H={H} history={S}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        print(f"H={H}: {total:.1f} ms per layer over {args.chunks} chunks, x32 layers = {32 * total:.0f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
