"""Quantized KV on the GPU: int8 / fp8 (e4m3) K/V with per-token, per-head fp32 scales.

1. Correctness first: the indexed decode kernel over int8 / fp8 pages (each in-register dequantization:
   "cast", "fp32", and for int8 "f16asm") against the reference path (gather the codes, dequantize, attend in fp32), bf16
   queries, Llama-3.1-8B's attention shape, uneven lengths, split-K; every output element written.
2. The kernel alone (one layer, timed in CUDA graphs) at batch 1 x 129,536 and batch 8 x 32,768 keys:
   bf16 pages against int8 and fp8 pages, each dequantization and a few launch settings; the fastest
   (summed over both shapes, as a share of its own floor) is what the engine rows below use.
3. The engine: decode time per token of the Llama-3.1-8B shape (random weights, bf16) with bf16, int8
   and fp8 KV, at batch 1 x 129,536 tokens (131,072 positions minus the new tokens) and batch 8 x
   32,768, through LLM.generate (the engine's turn driver and step loop, decode steps replayed from
   CUDA graphs one step ahead of the host). One engine per KV dtype, built as users build it
   (LLM(kv_dtype=...)), with the same random weights; the time per token is taken over the steps
   after `--warmup`.
   Floor = (weight bytes + the KV bytes a step reads, scales included) / copy bandwidth measured here.
   Targets: int8 decode within 1.25x of its own floor at 128K; at batch 8 x 32K at least
   1.35x faster than bf16 KV.
   Also, per dtype, how many greedy tokens agree with bf16 KV's before the first difference (random
   weights: a sanity check, not a quality figure; tests/ and benchmarks/quality/kv_quant_fidelity.py measure
   fidelity).

Usage: python benchmarks/decode/gpu_kv_quant.py [--out DIR] [--skip-kernels] [--skip-engine] [--steps 32]
       python benchmarks/decode/gpu_kv_quant.py --smoke        # CPU: tiny shape, the engine part only
Prints tables; JSON to --out (or $OUT) as gpu_kv_quant.json. About 3-4 minutes on an H100.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

import turnkv
from turnkv.attention import reference
from turnkv.bench import hardware
from turnkv.kv import quant
from turnkv.kv.pool import PagePool

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import gpu_timing  # noqa: E402

KV_DTYPES = [None, "int8", "fp8"]
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
DEQUANTS = {"int8": ("cast", "fp32", "f16asm"), "fp8": ("cast", "fp32")}  # turnkv/attention/triton/decode.py
H, G, D, PS = 8, 4, 128, 16  # Llama-3.1-8B attention: 8 KV heads, 32 query heads, head dim 128
CONFIGS = [dict(block_n=32, num_warps=2, num_stages=3), dict(block_n=64, num_warps=2, num_stages=3),
           dict(block_n=64, num_warps=4, num_stages=3), dict(block_n=64, num_warps=4, num_stages=4),
           dict(block_n=128, num_warps=4, num_stages=3), dict(block_n=128, num_warps=4, num_stages=2)]


MODEL_DTYPE = "bf16"  # how rows of unquantized KV are labelled (the model dtype)


def label(kv) -> str:
    return kv or MODEL_DTYPE


# ---- 1 and 2: the kernel --------------------------------------------------------------------------
def make_pages(B, lengths, device, seed=0):
    """bf16 pages of B x H lists with these per-head lengths, shuffled, and their int8 / fp8 forms."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-max(lengths) // PS)
    num_pages = B * H * width + 4
    k = torch.randn(num_pages, PS, D, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(num_pages, PS, D, device=device, generator=gen, dtype=torch.bfloat16)
    # rows of different magnitudes (per-token scales matter)
    k.mul_(torch.logspace(-1, 1, num_pages * PS, device=device).view(num_pages, PS, 1).to(torch.bfloat16))
    table = torch.randperm(num_pages, device=device, generator=gen)[: B * H * width].view(B, H, width).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device).view(1, H).expand(B, H).contiguous()
    q = torch.randn(B, H * G, D, device=device, generator=gen, dtype=torch.bfloat16)
    forms = {None: dict(k=k, v=v)}
    for kv, dtype in STORAGE.items():
        (kc, ks), (vc, vs) = quant.quantize(k, dtype), quant.quantize(v, dtype)
        forms[kv] = dict(k=kc, v=vc, k_scale=ks, v_scale=vs)
    return q, forms, table, lens


def kv_bytes(forms_kv, lengths, B) -> int:
    per_token = sum(t[0, 0].numel() * t.element_size() for t in forms_kv.values())  # K, V rows (+ scales)
    return B * sum(lengths) * per_token


def correctness(device) -> list[dict]:
    from turnkv.attention.triton.decode import PROGRAMS_PER_SM, choose_splits, indexed_decode

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    lengths = [1, 777, 4096, 5000, 16, 3000, 2048, 4095]
    q, forms, table, lens = make_pages(2, lengths, device, seed=1)
    exact = reference.indexed_decode(q.float(), forms[None]["k"].float(), forms[None]["v"].float(), table, lens)
    for kv in STORAGE:
        f = forms[kv]
        ref = reference.indexed_decode(q.float(), f["k"], f["v"], table, lens, k_scale=f["k_scale"], v_scale=f["v_scale"])
        for dequant in DEQUANTS[kv]:
            for splits in (1, choose_splits(2 * H, max(lengths), sms, programs_per_sm=PROGRAMS_PER_SM[STORAGE[kv]])):
                out = torch.full_like(q, float("nan"))
                indexed_decode(q, f["k"], f["v"], table, lens, splits, out=out, k_scale=f["k_scale"],
                               v_scale=f["v_scale"], dequant=dequant)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = {"kv": kv, "dequant": dequant, "splits": splits, "nan_left": bool(out.isnan().any()),
                       "rel_err_vs_reference": err,
                       "quantization_rel_err_vs_bf16_kv": ((ref - exact).norm() / exact.norm()).item(),
                       "ok": err < 1e-2 and not bool(out.isnan().any())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def time_graphed(fn, calls=20, repeat=15) -> float:
    """Seconds per call of `calls` back-to-back calls replayed from one CUDA graph: the median of `repeat`
    replays after one (benchmarks/gpu_timing.py; gpu_kv_quant_splits.py times with it too)."""
    return gpu_timing.time_graphed(fn, calls, repeat, warmup=1)


def kernel_timings(device, bw, sweep: bool) -> tuple[list[dict], dict]:
    from turnkv.attention.triton import decode as kernel

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = [(1, 129536), (8, 32768)]
    rows, score = [], {}
    for B, S in shapes:
        q, forms, table, lens = make_pages(B, [S] * H, device)
        base = None
        for kv in KV_DTYPES:
            f = forms[kv]
            splits = kernel.choose_splits(B * H, S, sms, programs_per_sm=4 if kv is None else
                                          kernel.PROGRAMS_PER_SM[STORAGE[kv]])
            floor = kv_bytes(f, [S] * H, B) / bw
            variants = [(None, None)] if kv is None else [(d, c) for d in DEQUANTS[kv]
                                                          for c in (CONFIGS if sweep else [None])]
            for dequant, cfg in variants:
                kw = {} if kv is None else dict(k_scale=f["k_scale"], v_scale=f["v_scale"], dequant=dequant)
                try:
                    t = time_graphed(lambda: kernel.indexed_decode(q, f["k"], f["v"], table, lens, splits,
                                                                   config=cfg, **kw))
                except Exception as e:  # e.g. a launch setting out of shared memory
                    print(f"{label(kv)} {dequant} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                base = t if kv is None else base
                row = {"batch": B, "keys": S, "kv": label(kv), "dequant": dequant, "config": cfg or "default",
                       "splits": splits, "us": t * 1e6, "floor_us": floor * 1e6, "of_floor": floor / t,
                       "speedup_vs_bf16": base / t}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if kv is not None:
                    key = (kv, dequant, json.dumps(cfg, sort_keys=True))
                    score[key] = score.get(key, 0.0) + floor / t
    best = {}
    for (kv, dequant, cfg), s in score.items():
        if kv not in best or s > best[kv][2]:
            best[kv] = (dequant, json.loads(cfg), s)
    chosen = {}
    for kv, (dequant, cfg, s) in best.items():
        dtype = STORAGE[kv]
        kernel.DEQUANT[dtype] = dequant
        if cfg:
            kernel.QUANT_CONFIG[dtype] = cfg
        chosen[kv] = {"dequant": dequant, "config": kernel.QUANT_CONFIG[dtype], "mean_of_floor": s / len(shapes)}
    print("chosen for the engine rows:", json.dumps(chosen), flush=True)
    return rows, chosen


# ---- 3: the engine ----------------------------------------------------------------------------------
def prompt(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 32000), (n,), generator=gen).tolist()


def engine(args, kv, tokens: int):
    """The engine as users build it for `kv` storage, with a page pool for `tokens` tokens (the same
    random weights for every dtype: the same seed)."""
    def kv_memory(config, dtype):
        per_token = config.num_layers * config.num_kv_heads * PagePool.token_head_bytes(config.head_dim, dtype, kv)
        slack = config.num_layers * config.num_kv_heads * 4 * PS * PagePool.token_head_bytes(config.head_dim, dtype, kv)
        return int(tokens * per_token * 1.02) + 40 * slack

    return turnkv.LLM(args.shape, dtype=args.dtype, device=args.device, kv_memory=kv_memory, page_size=PS,
                      max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk, kv_dtype=kv)


def engine_rows(args, bw) -> list[dict]:
    """Per KV dtype and case, `warmup + steps` greedy tokens of each prompt through LLM.generate (the
    path users take); ms per token over the steps that made the last `steps` tokens."""
    cases = [(1, args.long_context), (args.batch, args.batch_context)]
    need = max(cases[0][1] + args.warmup + args.steps + PS,
               args.batch * (args.batch_context + args.warmup + args.steps + PS))
    rows, reference_tokens = [], {}
    for kv in KV_DTYPES:
        llm = engine(args, kv, need)
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        for B, ctx in cases:
            prompts = [prompt(ctx, llm.config.vocab_size, b) for b in range(B)]
            replies = llm.generate(prompts, max_new_tokens=args.warmup + args.steps, ignore_eos=True)
            times = replies[0].token_times
            ms = (times[-1] - times[args.warmup - 1]) * 1000 / args.steps
            mid = ctx + args.warmup + args.steps / 2  # tokens a timed step reads, on average
            read = B * mid * llm.config.num_layers * llm.config.num_kv_heads * llm.pool.token_bytes
            floor_ms = (weight_bytes + read) / bw * 1000
            greedy = [r.token_ids for r in replies]
            row = {"kv": label(kv), "batch": B, "context": ctx, "ms_per_token": ms, "floor_ms": floor_ms,
                   "of_floor": floor_ms / ms, "tokens_per_s": B * 1000 / ms,
                   "kv_bytes_held": sum(r.kv_bytes for r in replies), "kv_bytes_read_per_step": int(read),
                   "weight_bytes": weight_bytes, "prefill_s": replies[0].ttft_s,
                   "kv_token_bytes_all_layers": llm.kv_bytes_per_token()}
            if kv is None:
                reference_tokens[(B, ctx)] = greedy
            else:
                base = next(r for r in rows if r["kv"] == label(None) and r["batch"] == B and r["context"] == ctx)
                row["speedup_vs_bf16"] = base["ms_per_token"] / ms
                ref = reference_tokens[(B, ctx)]
                agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(greedy, ref)]
                row["greedy_tokens_equal_before_first_difference"] = min(agree)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/decode/results")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--long-context", type=int, default=129536)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-context", type=int, default=32768)
    p.add_argument("--prefill-chunk", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--no-sweep", action="store_true", help="time each dequantization with the default launch only")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random shape, the engine part only")
    args = p.parse_args()
    if args.smoke:
        args.device, args.shape, args.dtype, args.max_model_len = "cpu", "smollm2-135m", "float32", 1024
        args.long_context, args.batch, args.batch_context, args.prefill_chunk = 300, 2, 120, 128
        args.warmup, args.steps, args.skip_kernels = 3, 4, True
    global MODEL_DTYPE
    MODEL_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(args.dtype, args.dtype)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    bw = hardware.copy_bandwidth(device)
    result = {"command": "python benchmarks/decode/gpu_kv_quant.py", "args": vars(args), "copy_bandwidth": bw,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(f"device {result['device']}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if not args.skip_kernels and device.type == "cuda":
        result["correctness"] = correctness(device)
        result["kernel"], result["chosen"] = kernel_timings(device, bw, sweep=not args.no_sweep)
    if not args.skip_engine:
        result["engine"] = engine_rows(args, bw)
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_kv_quant.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_tables(result)


def print_tables(result):
    if "correctness" in result:
        bad = [r for r in result["correctness"] if not r["ok"]]
        worst = max(r["rel_err_vs_reference"] for r in result["correctness"])
        print(f"\ncorrectness: {len(result['correctness']) - len(bad)}/{len(result['correctness'])} ok, "
              f"worst relative error vs reference {worst:.1e}" + (f"; FAILED: {bad}" if bad else ""))
    if "kernel" in result:
        print("\nkernel (one layer), best launch per (shape, kv, dequant):")
        print(f"{'shape':>14s} {'kv':>5s} {'dequant':>7s} {'us':>8s} {'floor us':>9s} {'of floor':>8s} {'vs bf16':>7s}  config")
        best = {}
        for r in result["kernel"]:
            key = (r["batch"], r["keys"], r["kv"], r["dequant"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        for r in best.values():
            print(f"{r['batch']:>3d} x {r['keys']:>8d} {r['kv']:>5s} {str(r['dequant']):>7s} {r['us']:8.1f} "
                  f"{r['floor_us']:9.1f} {r['of_floor']:8.2f} {r['speedup_vs_bf16']:6.2f}x  {r['config']}")
    if "engine" in result:
        print("\nengine decode (ms per token; floor = (weights + KV read incl. scales) / copy bandwidth):")
        print(f"{'kv':>5s} {'batch x context':>16s} {'ms/token':>9s} {'floor ms':>9s} {'of floor':>8s} "
              f"{'floor/ms >= 0.8':>15s} {'vs ' + label(None):>8s} {'KV GB read':>10s} {'same tokens':>11s}")
        for r in result["engine"]:
            sp = r.get("speedup_vs_bf16")
            same = r.get("greedy_tokens_equal_before_first_difference")
            print(f"{r['kv']:>5s} {r['batch']:>5d} x {r['context']:>8d} {r['ms_per_token']:9.2f} {r['floor_ms']:9.2f} "
                  f"{r['of_floor']:8.2f} {str(r['of_floor'] >= 0.8):>15s} {(f'{sp:.2f}x' if sp else '-'):>8s} "
                  f"{r['kv_bytes_read_per_step'] / 1e9:10.2f} {(str(same) if same is not None else '-'):>11s}")
        print("targets: int8 at batch 1 x 128K within 1.25x of its floor (of floor >= 0.80); "
              "int8 at batch 8 x 32K >= 1.35x faster than bf16")
    print(f"\nwall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
