"""The GPU path without custom kernels: PyTorch SDPA over gathered pages.

A baseline for the custom kernels to beat. Random weights at a real shape, bf16.
Usage: python benchmarks/decode/gpu_baseline.py [--shape llama-3.1-8b] [--contexts 4096,16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import turnkv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--contexts", default="4096,16384,32768")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llm = turnkv.LLM(args.shape, dtype="bfloat16", device="cuda", kv_memory="24GiB")
    weights = sum(t.numel() * t.element_size() for t in llm.model.parameters())
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        ids = torch.randint(0, 32000, (ctx,)).tolist()
        llm.generate(ids[:256], max_new_tokens=4, ignore_eos=True)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        r = llm.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True)
        kv = ctx * llm.config.kv_bytes_per_token(2)
        rows.append({"context": ctx, "batch": 1, "ttft_s": r.ttft_s, "tpot_ms": 1000 * r.time_per_token_s,
                     "tokens_per_s": r.tokens_per_s, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                     "bytes_per_token_read_gb": (weights + kv) / 1e9})
        print(rows[-1], flush=True)
    ctx = 4096
    prompts = [torch.randint(0, 32000, (ctx - 17 * i,)).tolist() for i in range(args.batch)]
    t = time.perf_counter()
    replies = llm.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    decode = max(r.decode_s for r in replies)
    rows.append({"context": ctx, "batch": args.batch, "wall_s": total,
                 "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / decode})
    print(rows[-1], flush=True)
    result = {"command": "python benchmarks/decode/gpu_baseline.py", "device": torch.cuda.get_device_name(),
              "shape": args.shape, "weight_gb": weights / 1e9, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print("| context | batch | TTFT s | ms/token | tok/s |")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r.get('ttft_s', float('nan')):.3f} | {r.get('tpot_ms', float('nan')):.1f} | "
              f"{r.get('tokens_per_s', r.get('decode_tokens_per_s')):.1f} |")


if __name__ == "__main__":
    main()
