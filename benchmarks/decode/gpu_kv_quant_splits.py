"""The int8 indexed decode kernel by programs per SM (choose_splits), launch setting and
dequantization, at batch 8 x 32K and 1 x 128K keys (Llama-3.1-8B's attention shape, the pages and
timing of benchmarks/decode/gpu_kv_quant.py), beside bf16 at its default launch. That script times the
chosen settings in the engine; this one shows why PROGRAMS_PER_SM is what it is.

Usage (a GPU): python benchmarks/decode/gpu_kv_quant_splits.py [--out DIR]   (JSON: gpu_kv_quant_splits.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kv_quant as bench  # noqa: E402

from turnkv.attention.triton import decode as kernel  # noqa: E402
from turnkv.bench import hardware  # noqa: E402

LAUNCHES = [dict(block_n=128, num_warps=4), dict(block_n=128, num_warps=2), dict(block_n=64, num_warps=2),
            dict(block_n=256, num_warps=4)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/decode/results")
    args = p.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = hardware.copy_bandwidth(device)
    rows = []
    for B, S in ((8, 32768), (1, 129536)):
        q, forms, table, lens = bench.make_pages(B, [S] * bench.H, device)
        bf16 = forms[None]
        bf16_s = bench.time_graphed(lambda: kernel.indexed_decode(
            q, bf16["k"], bf16["v"], table, lens, kernel.choose_splits(B * bench.H, S, sms)))
        f = forms["int8"]
        floor = bench.kv_bytes(f, [S] * bench.H, B) / bw
        for dequant in ("cast", "f16asm"):
            for launch in LAUNCHES:
                for stages in (2, 3):
                    for per_sm in (4, 6, 8, 12, 16):  # 4: the bf16 kernel's
                        splits = kernel.choose_splits(B * bench.H, S, sms, programs_per_sm=per_sm)
                        config = dict(launch, num_stages=stages)
                        seconds = bench.time_graphed(lambda: kernel.indexed_decode(
                            q, f["k"], f["v"], table, lens, splits, config=config, k_scale=f["k_scale"],
                            v_scale=f["v_scale"], dequant=dequant))
                        row = dict(batch=B, keys=S, dequant=dequant, **config, programs_per_sm=per_sm, splits=splits,
                                   us=seconds * 1e6, of_floor=floor / seconds, bf16_us=bf16_s * 1e6,
                                   speedup_vs_bf16=bf16_s / seconds)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        del forms
        torch.cuda.empty_cache()
    result = {"command": "python benchmarks/decode/gpu_kv_quant_splits.py", "device": torch.cuda.get_device_name(device),
              "copy_bandwidth": bw, "rows": rows}
    with open(os.path.join(args.out, "gpu_kv_quant_splits.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{'batch x keys':>14} {'dequant':>7} {'launch':>9} {'per SM':>6} {'splits':>6} {'us':>7} {'of floor':>8} "
          f"{'vs bf16':>7}")
    for r in sorted(rows, key=lambda r: (r["batch"], r["us"])):
        launch = f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}"
        print(f"{r['batch']:>4} x {r['keys']:>7} {r['dequant']:>7} {launch:>9} {r['programs_per_sm']:>6} {r['splits']:>6} "
              f"{r['us']:7.1f} {r['of_floor']:8.2f} {r['speedup_vs_bf16']:6.2f}x")


if __name__ == "__main__":
    main()
