"""Make a streaming-head pattern for SmolLM2-135M-Instruct on CPU: DuoAttention-style gate
optimisation (default) or attention statistics, on synthetic multi-passkey text made in code.

Writes <out>/lserve_pattern_smollm2.{json,tsv} (flags at --sparsity, gates and settings in the
JSON) and <out>/lserve_calibrate_smollm2.json (the loss history).

The CPU run is short (tens of steps at ~1K tokens, not DuoAttention's 2000 steps at 1K-32K), so the
gates rank heads but are not converged; the GPU path is the same call with more steps and tokens.

Usage: python benchmarks/sparse/lserve_calibrate.py [--method gates|stats] [--steps 40] [--tokens 1024]
       [--sink 128] [--local 256] [--sparsity 0.5] [--out benchmarks/sparse/results]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import turnkv
from turnkv.methods.lserve import calibrate_by_attention, optimize_gates, passkey_samples


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("gates", "stats"), default="gates")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--local", type=int, default=256)
    parser.add_argument("--reg-weight", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/sparse/results")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    llm = turnkv.LLM(args.model, device="cpu", dtype="float32", kv_memory="16MiB")
    samples = passkey_samples(llm.tokenizer, args.samples, args.tokens, args.keys, seed=0)
    start = time.perf_counter()
    if args.method == "gates":
        def log(row):
            print(f"step {row['step']:4d}  distill {row['distill']:.3e}  mean gate {row['reg']:.3f}  "
                  f"lr {row['lr']:.4f}  {time.perf_counter() - start:.0f}s", flush=True)

        result = optimize_gates(llm, args.steps, samples, args.sink, args.local, args.reg_weight, args.lr, log=log)
        pattern, history = result.pattern(args.sparsity), result.history
    else:
        pattern = calibrate_by_attention(llm, [s.tokens for s in samples], args.sink, args.local, args.sparsity)
        history = []
    seconds = time.perf_counter() - start
    pattern.meta.update({"model": llm.name, "method": args.method, "seconds": round(seconds, 1),
                         "data": f"synthetic multi-passkey, {args.samples} samples x ~{args.tokens} tokens, "
                                 f"{args.keys} keys", "threads": torch.get_num_threads()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pattern.save_json(out / "lserve_pattern_smollm2.json")
    pattern.save_tsv(out / "lserve_pattern_smollm2.tsv")
    (out / "lserve_calibrate_smollm2.json").write_text(json.dumps(
        {"meta": pattern.meta, "streaming_per_layer": pattern.streaming.sum(axis=1).tolist(),
         "history": history}, indent=1) + "\n")
    print(f"{args.method}: {pattern.streaming.sum()} of {pattern.streaming.size} KV heads streaming, "
          f"per layer {pattern.streaming.sum(axis=1).tolist()}, {seconds:.0f}s -> {out}")


if __name__ == "__main__":
    main()
