"""Host time of a decode step's token reservation (SequenceKV.reserve_on_host, the page-table work
a graphed or eager decode step does per stream), for B streams whose heads hold uneven token counts,
as after Ada-KV's compression. Runs on the CPU: it measures numpy work only.

    python benchmarks/serving/host_reserve.py --streams 64 --layers 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--history", type=int, default=4000, help="tokens per head before the uneven cut")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    L, H, page = args.layers, args.kv_heads, 16
    pages = args.streams * H * (args.history // page + args.steps) + 64
    pool = PagePool(L, H, 8, pages, page, dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(args.streams):
        seq = SequenceKV(pool)
        seq.reserve(args.history)
        for layer in range(L):  # each head keeps between 1/80 and 1/5 of its tokens
            seq.keep(layer, [np.sort(rng.choice(args.history, int(rng.integers(args.history // 80, args.history // 5)),
                                                replace=False)) for _ in range(H)])
        seqs.append(seq)
    start = time.perf_counter()
    for _ in range(args.steps):
        for seq in seqs:
            seq.reserve_on_host(1)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"{args.streams} streams x {L} layers x {H} KV heads: {per_step * 1000:.2f} ms of host time per decode step")


if __name__ == "__main__":
    main()
