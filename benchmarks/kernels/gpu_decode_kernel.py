"""Indexed decode kernel on the GPU: time per layer call against the bytes it must read.

Checks the kernel against the reference first, then times it for Llama-3.1-8B's attention shape
(32 query heads, 8 KV heads, head dim 128, bf16) at several contexts and batch sizes, beside
PyTorch SDPA over the same keys already contiguous (the attention floor a gather-free path could
reach) and the reference path (gather + SDPA). Also times Ada-KV-like uneven per-head lengths.

    python benchmarks/kernels/gpu_decode_kernel.py --out benchmarks/kernels/results/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from turnkv.attention import reference
from turnkv.attention.triton.decode import choose_splits, indexed_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.gpu_timing import time_cuda, time_graphed  # noqa: E402


def copy_bandwidth(device) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    return 2 * x.numel() / time_cuda(lambda: y.copy_(x), repeat=20)


def sweep(device, sms, bw):
    """Launch settings against three shapes, timed in graphs."""
    H, G, D, ps = 8, 4, 128, 16
    shapes = [(1, 32768), (1, 131072), (32, 16384)]
    print(f"{'config':32s} " + " ".join(f"B={b} S={s:>6d} us(floor)" for b, s in shapes))
    best = {}
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3, 4):
                cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                cells = []
                for B, S in shapes:
                    q, k, v, table, lengths = make(B, H, G, D, [S] * H, ps, torch.bfloat16, device)
                    splits = choose_splits(B * H, S, sms)
                    try:
                        t = time_graphed(lambda: indexed_decode(q, k, v, table, lengths, splits, config=cfg))
                    except Exception as e:  # e.g. out of shared memory for this config
                        cells.append(f"{'fail':>20s}")
                        print(type(e).__name__, str(e)[:100])
                        continue
                    floor = 2 * B * H * S * D * 2 / bw
                    best.setdefault((B, S), []).append((t, cfg))
                    cells.append(f"{t * 1e6:10.1f} ({floor / t:4.2f})  ")
                print(f"{str(cfg):32s} " + " ".join(cells), flush=True)
    for key, results in best.items():
        t, cfg = min(results, key=lambda r: r[0])
        print("best", key, f"{t * 1e6:.1f} us", cfg)


def make(B, H, G, D, S_per_head, ps, dtype, device, seed=0):
    torch.manual_seed(seed)
    width = -(-max(S_per_head) // ps)
    num_pages = B * H * width + 8
    k = torch.randn(num_pages, ps, D, dtype=dtype, device=device)
    v = torch.randn(num_pages, ps, D, dtype=dtype, device=device)
    table = torch.randperm(num_pages, device=device)[: B * H * width].view(B, H, width).to(torch.int32)
    lengths = torch.tensor(S_per_head, dtype=torch.int32, device=device).view(1, H).expand(B, H).contiguous()
    q = torch.randn(B, H * G, D, dtype=dtype, device=device)
    return q, k, v, table, lengths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="time launch settings instead")
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name(0)}  copy bandwidth {bw / 1e12:.2f} TB/s  SMs {sms}")
    if args.sweep:
        return sweep(device, sms, bw)
    H, G, D, ps, dtype = 8, 4, 128, 16, torch.bfloat16
    rows = []
    cases = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (32, 16384)]
    for B, S in cases:
        q, k, v, table, lengths = make(B, H, G, D, [S] * H, ps, dtype, device)
        splits = choose_splits(B * H, S, sms)
        ref = reference.indexed_decode(q.float(), k.float(), v.float(), table, lengths)
        out = indexed_decode(q, k, v, table, lengths, splits)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        t_kernel = time_graphed(lambda: indexed_decode(q, k, v, table, lengths, splits))
        kc = reference.gather_pages(k, table, S)
        vc = reference.gather_pages(v, table, S)
        t_sdpa = time_graphed(lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True))
        t_ref = time_cuda(lambda: reference.indexed_decode(q, k, v, table, lengths), repeat=10)
        kv_bytes = 2 * B * H * S * D * 2
        row = dict(case=f"dense B={B} S={S}", splits=splits, rel_err=err, kernel_us=t_kernel * 1e6,
                   sdpa_contig_us=t_sdpa * 1e6, reference_us=t_ref * 1e6, floor_us=kv_bytes / bw * 1e6)
        row["floor_fraction"] = row["floor_us"] / row["kernel_us"]
        rows.append(row)
    # Ada-KV-like: 10% of 128K kept on average, spread unevenly over the heads.
    S = 131072
    keep = [int(S * f) for f in (0.02, 0.05, 0.05, 0.08, 0.1, 0.12, 0.18, 0.2)]
    q, k, v, table, lengths = make(1, H, G, D, keep, ps, dtype, device)
    splits = choose_splits(H, max(keep), sms)
    ref = reference.indexed_decode(q.float(), k.float(), v.float(), table, lengths)
    out = indexed_decode(q, k, v, table, lengths, splits)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    t_kernel = time_graphed(lambda: indexed_decode(q, k, v, table, lengths, splits))
    kv_bytes = 2 * sum(keep) * D * 2
    rows.append(dict(case="ada 10% of 128K, uneven", splits=splits, rel_err=err, kernel_us=t_kernel * 1e6,
                     sdpa_contig_us=float("nan"), reference_us=float("nan"), floor_us=kv_bytes / bw * 1e6,
                     floor_fraction=kv_bytes / bw / t_kernel))
    print(f"{'case':28s} {'splits':>6s} {'rel_err':>8s} {'kernel us':>10s} {'sdpa(contig) us':>15s} "
          f"{'gather+sdpa us':>14s} {'floor us':>9s} {'of floor':>8s}")
    for r in rows:
        print(f"{r['case']:28s} {r['splits']:6d} {r['rel_err']:8.1e} {r['kernel_us']:10.1f} {r['sdpa_contig_us']:15.1f} "
              f"{r['reference_us']:14.1f} {r['floor_us']:9.1f} {r['floor_fraction']:8.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_kernel.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), copy_bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
