"""Launch settings of the paged chunk kernel's ring iterator (LServe's streaming heads in prefill):
time each setting on the Llama-3.1-8B shape's streaming heads (4 of 8 KV heads, sink 128, window
8192) for a first 32K chunk and a later 32K chunk over a kept ring, beside cuDNN's causal attention
of one dense KV head over the same chunk (what a dense head costs), and print TFLOP/s of the cells
each computes.

    python benchmarks/prefill/ring_configs.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch

from turnkv.attention import chunk
from turnkv.attention.triton.chunk_prefill import chunk_attention
from turnkv.methods.protocols import NO_WINDOW

CONFIGS = [
    dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=64, num_warps=4, num_stages=4),
    dict(block_m=128, block_n=32, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=256, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=256, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=256, block_n=64, num_warps=8, num_stages=4),
    dict(block_m=256, block_n=32, num_warps=8, num_stages=3),
    dict(block_m=256, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=256, block_n=64, num_warps=16, num_stages=3),
    dict(block_m=256, block_n=128, num_warps=16, num_stages=2),
]


def timed(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    H, G, D, page, T, sink, window = 8, 4, 128, 16, 32768, 128, 8192
    streaming = torch.arange(1, H, 2, dtype=torch.int32, device="cuda")
    windows = torch.full((H,), NO_WINDOW, dtype=torch.int32, device="cuda")
    windows[streaming.long()] = window
    rows = []
    for kept in (0, sink + window):
        n = kept + T
        width = -(-n // page)
        pages = H * width
        k = torch.randn(pages, page, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.arange(pages, device="cuda", dtype=torch.int32).view(1, H, width)
        lengths = torch.full((1, H), n, device="cuda", dtype=torch.int32)
        q = torch.randn(1, T, H * G, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        out = torch.empty_like(q)
        # Cells per streaming query head: each row sees its sink and the last `window` keys.
        p = torch.arange(kept, n, device="cuda", dtype=torch.float64)
        cells = float((torch.clamp(p + 1 - sink, max=window) + torch.clamp(p + 1, max=sink)).sum()) * len(streaming) * G
        flops = 4 * D * cells
        row = {"kept": kept, "T": T, "streaming_cells": cells, "ms": {}, "tflops": {}}
        for config in CONFIGS:
            name = "m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**config)
            try:
                ms = timed(lambda: chunk_attention(q, k, v, table, lengths, 1, window=windows, sink=sink, ring=True,
                                                   heads=streaming, out=out, config=config))
            except Exception as e:  # a setting that does not fit the SM's shared memory
                row["ms"][name] = repr(e)[:200]
                continue
            row["ms"][name], row["tflops"][name] = ms, flops / ms / 1e9
        # One dense KV head's causal attention over the chunk (cuDNN), for scale.
        qd = q[:, :G]
        kd = torch.randn(1, 1, T, D, device="cuda", dtype=torch.bfloat16)
        ms = timed(lambda: chunk.fresh_causal(qd, kd, kd))
        row["ms"]["dense_head_cudnn"] = ms
        row["tflops"]["dense_head_cudnn"] = 4 * D * G * T * (T + 1) / 2 / ms / 1e9
        rows.append(row)
        print(f"kept {kept}: " + ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
