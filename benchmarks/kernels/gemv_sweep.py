"""Launch settings of the skinny matmul (turnkv/model/triton/gemv.py) swept per Llama-3.1-8B projection
and row count: `python benchmarks/kernels/gpu_step_kernels.py --sweep` runs it (see that script)."""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
import triton
from gpu_step_kernels import DEVICE, DTYPE, SHAPES, rel_err, sync, time_graphed, weight_copies

from turnkv.model.triton import gemv


def candidate_configs(M: int) -> list[dict]:
    configs = []
    for block_n, block_k, stages in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 6)):
        if block_n * block_k * 2 * stages > 160 * 1024:  # shared memory of the pipeline
            continue
        for warps in ((4,) if block_n < 64 else (4, 8)):
            configs.append(dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, split_k=1, dot=True))
    if M <= 2:
        for block_n, block_k, warps in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
            if block_n * block_k * M > 16384:  # the accumulator would spill
                continue
            configs.append(dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=1, split_k=1, dot=False))
    return configs


def with_splits(config: dict, N: int, K: int, sms: int) -> list[dict]:
    """The config, and split-K versions of it where its tiles alone leave SMs short."""
    out = [config]
    tiles = triton.cdiv(N, config["block_n"])
    if tiles < sms:
        for split in (2, 4):
            if K // split >= 2 * config["block_k"] and tiles * split <= 8 * sms:
                out.append(dict(config, split_k=split))
    return out


def _compile_some(jobs):
    """In a worker process: run each (M, K, config) once on small tensors with the same
    specialisation as the real shapes, which puts its binary in Triton's on-disk cache."""
    failed = 0
    for M, K, config in jobs:
        try:
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            w = torch.randn(64, K, device=DEVICE, dtype=DTYPE)
            gemv.skinny_matmul(x, w, config=config)
        except Exception:  # noqa: BLE001 (e.g. out of shared memory: the sweep skips it too)
            failed += 1
    sync()
    return failed


def precompile(jobs: list, workers: int) -> None:
    """Compile the sweep's kernels in parallel processes (one compile is seconds, and the sweep has
    a hundred); the timing process then loads them from the cache."""
    unique = list({json.dumps([M, K, c], sort_keys=True): (M, K, c) for M, K, c in jobs}.values())
    chunks = [unique[i::workers] for i in range(workers)]
    start = time.perf_counter()
    try:
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failed = sum(pool.map(_compile_some, [c for c in chunks if c]))
        print(f"precompiled {len(unique)} kernels in {time.perf_counter() - start:.0f} s ({failed} failed)", flush=True)
    except Exception as e:  # noqa: BLE001 (compile in the timing process instead)
        print("precompile failed, compiling in turn:", type(e).__name__, str(e)[:200])


def sweep(bw, rows_list, shape_names, workers) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [s for s in SHAPES if s[0] in shape_names]
    plan = []
    for name, N, K, _ in shapes:
        for M in rows_list:
            for base in candidate_configs(M):
                for config in with_splits(base, N, K, sms):
                    plan.append((name, N, K, M, config))
    print(f"sweep: {len(plan)} timings", flush=True)
    precompile([(M, 2048 if K % 2048 == 0 else K, c) for _, _, K, M, c in plan], workers)
    results = []
    for name, N, K, _ in shapes:
        copies = weight_copies(N, K)
        ref_w = copies[0]
        for M in rows_list:
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            ref = F.linear(x.float(), ref_w.float())
            cublas = time_graphed([lambda w=w: F.linear(x, w) for w in copies])
            default = time_graphed([lambda w=w: gemv.skinny_matmul(x, w) for w in copies])
            cells = []
            for _, _, _, m, config in [p for p in plan if p[0] == name and p[3] == M]:
                try:
                    err = rel_err(gemv.skinny_matmul(x, ref_w, config=config), ref)
                    if not err < 1e-2:
                        print(f"  {name} M={M} {config}: WRONG, rel err {err:.2e}")
                        continue
                    t = time_graphed([lambda w=w: gemv.skinny_matmul(x, w, config=config) for w in copies])
                except Exception as e:  # noqa: BLE001 (out of resources: skip the setting)
                    print(f"  {name} M={M} {config}: {type(e).__name__} {str(e)[:80]}")
                    continue
                cells.append(dict(config=config, us=t * 1e6, of_copy=N * K * 2 / t / bw))
            cells.sort(key=lambda c: c["us"])
            best = cells[0] if cells else None
            results.append(dict(proj=name, N=N, K=K, M=M, cublas_us=cublas * 1e6, default_us=default * 1e6,
                                default_of_copy=N * K * 2 / default / bw, best=best, all=cells))
            if best:
                print(f"{name:10s} M={M:<2d} cuBLAS {cublas * 1e6:7.1f} us  default {default * 1e6:7.1f} us "
                      f"({N * K * 2 / default / bw:.2f})  best {best['us']:7.1f} us ({best['of_copy']:.2f}) {best['config']}",
                      flush=True)
        del copies
        torch.cuda.empty_cache()
    summary = summarize_sweep(results, rows_list)
    return dict(results=results, summary=summary)


def summarize_sweep(results, rows_list) -> dict:
    """Best setting per shape (TUNED form), and per row count the split-K-free setting with the best
    mean fraction of copy bandwidth over the shapes."""
    tuned = {}
    print("\n# turnkv/model/triton/gemv.py TUNED entries (rows, N, K): config")
    for r in results:
        if r["best"]:
            key = (triton.next_power_of_2(r["M"]), r["N"], r["K"])
            tuned[str(key)] = r["best"]["config"]
            print(f"    {key}: {r['best']['config']},  # {r['proj']}: {r['best']['us']:.1f} us, "
                  f"{r['best']['of_copy']:.2f} of copy; cuBLAS {r['cublas_us']:.1f} us")
    per_rows = {}
    for M in rows_list:
        scores = {}
        group = [r for r in results if r["M"] == M]
        for r in group:
            for cell in r["all"]:
                if cell["config"]["split_k"] == 1:
                    scores.setdefault(json.dumps(cell["config"], sort_keys=True), []).append(cell["of_copy"])
        complete = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == len(group)}
        if complete:
            best = max(complete, key=complete.get)
            per_rows[M] = dict(config=json.loads(best), mean_of_copy=complete[best])
            print(f"best single setting at M={M}: {best} (mean {complete[best]:.2f} of copy)")
    return dict(tuned=tuned, per_rows=per_rows)


# --- main --------------------------------------------------------------------------------------------
