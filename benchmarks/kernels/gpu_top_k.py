"""Exact top-k kernels against torch.topk + sort, timed as CUDA-graph replays, each checked against a
stable sort: the radix select of long rows (turnkv/attention/triton/radix_top_k.py; counting rounds
over chunks of 4096 to 16384, compaction and write over chunks of 1024 to 4096) and the short-row kernel (top_k.py; one program per row, or split over parts and merged).
Prints a table; JSON to $OUT/top_k.json.

    python benchmarks/kernels/gpu_top_k.py     # H100: ~1 min
"""
import json
import os
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.gpu_timing import time_graphed
from turnkv.attention.triton import radix_top_k as R, top_k as S


def ref(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


torch.manual_seed(0)
rows_out = []
for rows, n, k in ((32, 131072, 1024), (8, 131072, 1024), (32, 32768, 1024), (32, 2048, 63), (16, 2048, 63)):
    x = torch.rand(rows, n, device="cuda").pow(6)
    x[:, -100:] = float("-inf")
    x[:, :4] = float("inf")
    want = ref(x, k)
    variants = {"torch topk+sort": lambda: x.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values}
    if n > S.MAX_ROW:
        for chunk, write in ((8192, 2048), (4096, 2048), (16384, 2048), (8192, 1024), (8192, 4096)):
            variants[f"radix {chunk}/{write}"] = lambda c=chunk, w=write: R.top_k_ascending(x, k, chunk=c,
                                                                                           write_chunk=w)
    else:
        variants["one program"] = lambda: S.top_k_ascending(x, k, split=False)
        variants["split"] = lambda: S.top_k_ascending(x, k, split=True)
    for name, fn in variants.items():
        exact = torch.equal(fn(), want) if name != "torch topk+sort" else None
        us = time_graphed(fn, calls=1, repeat=50, warmup=1, back_to_back=True) * 1e6
        rows_out.append(dict(rows=rows, n=n, k=k, variant=name, us=us, exact=exact))
        print(f"[{rows:2d}, {n:6d}] k={k:4d}  {name:22s} {us:7.1f} us  exact={exact}")
json.dump(rows_out, open(os.path.join(os.environ.get("OUT", "."), "top_k.json"), "w"), indent=1)
