"""Vertical + slash line prefill kernel on the GPU: time per layer call against dense flash attention.

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16), lines per query head
as LoopServe selects them. First a correctness check against the reference mask path at a small size,
then, per context (32K, 64K, 128K; a whole-context first turn, and 4K new rows over a long history):
- SDPA dense causal (bottom-right, flash where PyTorch picks it: the engine's dense prefill path);
- the line kernel with every offset selected (dense causal through our kernel: its efficiency);
- the line kernel on realistic line sets at ~3%, 10% and 20% of the causal cells: 64 sink columns, a
  local window of slashes and scattered columns ("local"), plus scattered slashes at log-uniform
  offsets ("mixed"); the actual density is counted exactly and reported;
- the host-side preparation lines.line_attention adds (layout check, cell counts, the plan);
and LoopServe's selection (sampled softmax, sums, sorts, greedy) at 128K, stage by stage.

    python3 benchmarks/kernels/gpu_line_attention.py --out benchmarks/kernels/results/h100_line_attention.json
    python3 benchmarks/kernels/gpu_line_attention.py --sweep     # launch settings instead
    python3 benchmarks/kernels/gpu_line_attention.py --smoke     # tiny shapes, CPU interpreter allowed

The table is printed last; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPE = dict(Hq=32, H=8, D=128)
SMOKE_SHAPE = dict(Hq=4, H=2, D=32)
SMOKE_TILES = dict(block_m=16, block_n=16, num_warps=2, num_stages=1)
DENSITIES = (0.03, 0.10, 0.20)
FAMILIES = ("local", "mixed")  # line sets without / with scattered slashes (realistic_lines)
SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
         for m, n, w, st in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                             (64, 32, 4, 3)]]


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/kernels/results/h100_line_attention.json")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--history-rows", type=int, default=4096, help="new rows over a long history (0: skip)")
    ap.add_argument("--select-max-lines", type=int, default=2048,
                    help="cap of LoopServe's greedy per head: random inputs have no concentrated heads, so "
                         "alpha would take nearly every line")
    ap.add_argument("--sweep", action="store_true", help="time launch settings at 32K instead")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU under TRITON_INTERPRET=1")
    return ap.parse_args()


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

import triton  # noqa: E402
import triton.testing  # noqa: E402

from turnkv.attention import lines, reference  # noqa: E402
from turnkv.attention.triton import lines as kernel  # noqa: E402
from turnkv.methods.loopserve.prefill import LoopServePrefill  # noqa: E402


# ---- inputs -------------------------------------------------------------------------------------

def make_keys(n: int, T: int, shape: dict, dtype, device, seed=0) -> lines.Keys:
    """T new rows (the last T positions) over n keys at their entry positions."""
    torch.manual_seed(seed)
    Hq, H, D = shape["Hq"], shape["H"], shape["D"]
    q = torch.randn(1, Hq, T, D, dtype=dtype, device=device)
    k = torch.randn(1, H, n, D, dtype=dtype, device=device)
    v = torch.randn(1, H, n, D, dtype=dtype, device=device)
    q_pos = torch.arange(n - T, n, device=device)[None]
    k_pos = torch.arange(n, device=device).expand(1, H, n)
    return lines.Keys(q, k, v, q_pos, k_pos, None, n - T, n)


def take_until(cells: torch.Tensor, priority: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Per unit, the lines in ascending priority until their cells reach the budget: bool like priority."""
    order = priority.argsort(dim=1)
    spent = cells.expand_as(priority).gather(1, order).cumsum(dim=1)
    chosen = torch.zeros_like(priority, dtype=torch.bool)
    return chosen.scatter_(1, order, spent <= budget[:, None])


def realistic_lines(units: int, n: int, T: int, density: float, device, seed=0, sinks=64, scattered_slashes=True):
    """Lines covering ~density of the causal cells of T rows over n keys, as selected heads look:
    64 sink columns, half the rest a local window of slashes, then scattered slashes (offsets drawn
    log-uniformly: near diagonals are likelier) and scattered columns, a quarter of the budget each;
    without scattered_slashes the columns take that quarter too.

    Scattered slashes are the expensive kind for any block kernel: a lone diagonal crosses BLOCK_M +
    BLOCK_N keys of every query block, so the "local" family shows the kernel's best case and the
    "mixed" family a harder one."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = n - T
    causal = T * (h + 1) + T * (T - 1) / 2  # rows p in [h, n) see p + 1 keys
    budget = density * causal
    idx = torch.arange(n, device=device)
    line_cells = (n - idx.clamp_min(h)).double()  # a column c or an offset d covers rows [max(h, .), n)
    vertical = torch.zeros(units, n, dtype=torch.bool, device=device)
    vertical[:, :sinks] = True
    rest = budget - float(line_cells[:sinks].sum())
    window = int(torch.searchsorted(line_cells.cumsum(0), torch.tensor(rest / 2, device=device, dtype=torch.float64)))
    window = max(window, 1)
    slash = torch.zeros(units, n, dtype=torch.bool, device=device)
    slash[:, :window] = True
    left = torch.full((units,), rest / 4, dtype=torch.float64, device=device)
    # Exponential races give weighted sampling without replacement: priority = Exp(1) / weight.
    race = -torch.rand(units, n, generator=gen, device=device, dtype=torch.float64).log()
    # Lines already taken sort last and cost nothing, so they never stop the cumulative sum early.
    far = idx >= window
    if scattered_slashes:
        slash |= take_until(line_cells * far, torch.where(far, race * (idx + 1), math.inf), left) & far
    else:
        left = left * 2
    race = -torch.rand(units, n, generator=gen, device=device, dtype=torch.float64).log()
    free = idx >= sinks
    vertical |= take_until(line_cells * free, torch.where(free, race, math.inf), left) & free
    return vertical, slash, window


# ---- timing -------------------------------------------------------------------------------------

def bench(fn, device, rep_ms=200) -> float:
    """Milliseconds per call: triton's do_bench (CUDA events, median) on a GPU, wall clock otherwise."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_for(keys, vertical, slash, config=None):
    q_start, kv_len = lines.kernel_layout(keys)
    return kernel.Plan(vertical, slash, q_start, kv_len, keys.q.shape[2], keys.group, True, keys.window,
                       kernel.block_m_for(keys.q.dtype, config))


# ---- parts --------------------------------------------------------------------------------------

def correctness(shape, dtype, device, config, sizes):
    """Kernel against blockwise_attention over line_mask (fp32) at small sizes: error and counts."""
    rows = []
    for n, T in sizes:
        keys = make_keys(n, T, shape, dtype, device, seed=1)
        keys32 = lines.Keys(keys.q.float(), keys.k.float(), keys.v.float(), keys.q_pos, keys.k_pos, None,
                            keys.first_position, keys.end_position)
        for density in (*DENSITIES, 1.0):
            if density == 1.0:
                vertical = torch.zeros(shape["Hq"], n, dtype=torch.bool, device=device)
                slash = torch.ones(shape["Hq"], n, dtype=torch.bool, device=device)
            else:
                vertical, slash, _ = realistic_lines(shape["Hq"], n, T, density, device, seed=2, sinks=min(64, n // 8))
            out, computed, causal = lines.line_attention(keys, vertical, slash, True, force_triton=True, config=config)
            ref, ref_computed, _ = lines.blockwise_attention(
                keys32, lambda r: lines.line_mask(keys32, vertical, slash, True, r))
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ok = err < 1e-2 and torch.equal(computed, ref_computed)
            rows.append(dict(n=n, rows=T, density=float(computed.sum() / causal.sum()), rel_err=err,
                             counts_equal=bool(torch.equal(computed, ref_computed)), ok=ok))
            print(f"check n={n} rows={T} density={rows[-1]['density']:.3f} rel_err={err:.1e} "
                  f"counts_equal={rows[-1]['counts_equal']}", flush=True)
    return rows


def sdpa_dense(keys):
    """The engine's dense prefill path: SDPA, bottom-right causal, GQA without copying K/V."""
    return reference.causal_suffix(keys.q, keys.k, keys.v)


def time_case(n, T, shape, dtype, device, config, rep_ms):
    """Dense SDPA, the kernel on every offset, and the kernel at each density, for one shape."""
    keys = make_keys(n, T, shape, dtype, device)
    Hq, D = shape["Hq"], shape["D"]
    causal_cells = Hq * (T * (n - T + 1) + T * (T - 1) / 2)
    flops = lambda cells: 4 * cells * D  # noqa: E731  (QK^T and PV, 2 flops per multiply-add)
    out = dict(context=n, new_rows=T, history=n - T)
    t = bench(lambda: sdpa_dense(keys), device, rep_ms)
    out["sdpa_dense_ms"] = t
    out["sdpa_dense_tflops"] = flops(causal_cells) / t / 1e9
    every = torch.ones(Hq, n, dtype=torch.bool, device=device)
    none = torch.zeros(Hq, n, dtype=torch.bool, device=device)
    plan = plan_for(keys, none, every, config)
    t = bench(lambda: kernel.line_attention(keys.q, keys.k, keys.v, plan, config=config), device, rep_ms)
    out["kernel_dense_ms"] = t
    out["kernel_dense_tflops"] = flops(causal_cells) / t / 1e9
    out["densities"] = []

    def prepare(vertical, slash):  # what lines.line_attention does besides the kernel
        layout = lines.kernel_layout(keys)
        lines.contiguous_counts(keys, vertical, slash, True, *layout)
        return plan_for(keys, vertical, slash, config)

    for family in FAMILIES:
        for target in DENSITIES:
            vertical, slash, window = realistic_lines(Hq, n, T, target, device, seed=3, sinks=min(64, max(1, n // 16)),
                                                      scattered_slashes=family == "mixed")
            plan = plan_for(keys, vertical, slash, config)
            computed, causal = lines.contiguous_counts(keys, vertical, slash, True, *lines.kernel_layout(keys))
            t_kernel = bench(lambda: kernel.line_attention(keys.q, keys.k, keys.v, plan, config=config), device, rep_ms)
            t_prep = bench(lambda: prepare(vertical, slash), device, rep_ms=20)
            row = dict(family=family, target=target, density=float(computed.sum() / causal.sum()), local_window=window,
                       vertical_lines=float(vertical.sum(1).float().mean()),
                       slash_lines=float(slash.sum(1).float().mean()),
                       slash_runs=float(plan.run_count.float().mean()),
                       slash_segments=float(plan.seg_count.float().mean()), kernel_ms=t_kernel, prepare_ms=t_prep,
                       speedup_vs_sdpa=out["sdpa_dense_ms"] / t_kernel,
                       tflops_on_computed=flops(float(computed.sum())) / t_kernel / 1e9)
            out["densities"].append(row)
            print(f"n={n} rows={T} {family} target={target:.2f} density={row['density']:.3f} kernel={t_kernel:.2f} ms "
                  f"prepare={t_prep:.2f} ms sdpa={out['sdpa_dense_ms']:.2f} ms", flush=True)
    print(f"n={n} rows={T} sdpa dense {out['sdpa_dense_ms']:.2f} ms ({out['sdpa_dense_tflops']:.0f} TFLOP/s), "
          f"kernel dense {out['kernel_dense_ms']:.2f} ms ({out['kernel_dense_tflops']:.0f} TFLOP/s)", flush=True)
    return out


def selection(n, shape, dtype, device, max_lines):
    """LoopServe's select (Alg. 5 lines 1-17) for one layer of a whole-context turn, by stage."""
    keys = make_keys(n, n, shape, dtype, device, seed=4)
    method = LoopServePrefill(max_lines=max_lines, profile=True)
    method.select(keys, layer=0)  # warm-up (allocator, kernels)
    sync(device)
    t0 = time.perf_counter()
    times = {}
    vertical, slash, *_ = method.select(keys, layer=0, times=times)
    sync(device)
    t1 = time.perf_counter()
    return dict(context=n, max_lines=max_lines, total_ms=(t1 - t0) * 1e3,
                random_select_ms=(times["random_select"] - t0) * 1e3,
                search_ms=(t1 - times["random_select"]) * 1e3,
                lines_per_head=float((vertical.sum(1) + slash.sum(1)).float().mean()))


def sweep(shape, dtype, device, n, rep_ms):
    keys = make_keys(n, n, shape, dtype, device)
    vertical, slash, _ = realistic_lines(shape["Hq"], n, n, 0.10, device, seed=3)
    every = torch.ones_like(slash)
    none = torch.zeros_like(vertical)
    rows = []
    for config in SWEEP:
        row = dict(config=config)
        for name, (v, s) in dict(dense=(none, every), lines10=(vertical, slash)).items():
            try:
                plan = plan_for(keys, v, s, config)
                row[name + "_ms"] = bench(lambda: kernel.line_attention(keys.q, keys.k, keys.v, plan, config=config),
                                          device, rep_ms)
            except Exception as e:  # e.g. out of shared memory for this config
                row[name + "_ms"] = None
                print(type(e).__name__, str(e)[:200])
        rows.append(row)
        print(row, flush=True)
    return rows


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("needs a CUDA GPU (or --smoke for the interpreter at tiny shapes)")
    smoke = args.smoke
    shape = SMOKE_SHAPE if smoke else SHAPE
    dtype = torch.float16 if smoke and device.type == "cpu" else torch.bfloat16  # numpy has no bfloat16
    config = SMOKE_TILES if smoke else None
    rep_ms = 20 if smoke else 100
    result = dict(device=torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, triton=triton.__version__, shape=shape, dtype=str(dtype),
                  config=config or kernel.DEFAULT_CONFIG, smoke=smoke)
    print(f"device {result['device']}  torch {torch.__version__}  triton {triton.__version__}  {shape} {dtype}",
          flush=True)

    sizes = [(96, 96), (112, 40)] if smoke else [(2048, 2048), (3000, 700)]
    result["correctness"] = correctness(shape, dtype, device, config, sizes)
    if not all(r["ok"] for r in result["correctness"]):
        print("CORRECTNESS CHECK FAILED: timings below are of a wrong kernel", flush=True)

    if args.sweep:
        result["sweep"] = sweep(shape, dtype, device, 96 if smoke else 32768, rep_ms)
    else:
        contexts = [96, 128] if smoke else [int(x) for x in args.contexts.split(",")]
        history_rows = 32 if smoke else args.history_rows
        result["cases"] = []
        for n in contexts:
            result["cases"].append(time_case(n, n, shape, dtype, device, config, rep_ms))
            if history_rows and history_rows < n:
                result["cases"].append(time_case(n, history_rows, shape, dtype, device, config, rep_ms))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        n_select = max(contexts)
        result["selection"] = selection(n_select, shape, dtype, device, 64 if smoke else args.select_max_lines)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print()
    print(f"correctness: {sum(r['ok'] for r in result['correctness'])}/{len(result['correctness'])} ok, "
          f"max rel err {max(r['rel_err'] for r in result['correctness']):.1e}")
    if "sweep" in result:
        print(f"{'config':60s} {'dense ms':>9s} {'10% ms':>9s}")
        for r in result["sweep"]:
            fmt = lambda x: f"{x:9.2f}" if x is not None else f"{'fail':>9s}"  # noqa: E731
            print(f"{str(r['config']):60s} {fmt(r['dense_ms'])} {fmt(r['lines10_ms'])}")
    else:
        print("ms per layer call (all 32 heads); x = speed-up over SDPA dense; density = computed / causal cells")
        print(f"{'context':>8s} {'rows':>7s} {'lines':>6s} {'sdpa ms':>9s} {'ours dense':>10s} "
              + " ".join(f"{f'~{int(d * 100)}%: dens  ms  x':>24s}" for d in DENSITIES) + f" {'prep ms':>8s}")
        for c in result["cases"]:
            for family in FAMILIES:
                rows = [r for r in c["densities"] if r["family"] == family]
                cells = " ".join(f"{r['density']:6.3f} {r['kernel_ms']:9.2f} {r['speedup_vs_sdpa']:5.1f}x"
                                 for r in rows)
                print(f"{c['context']:8d} {c['new_rows']:7d} {family:>6s} {c['sdpa_dense_ms']:9.2f} "
                      f"{c['kernel_dense_ms']:10.2f} {cells} {max(r['prepare_ms'] for r in rows):8.2f}")
        s = result["selection"]
        print(f"LoopServe select at {s['context']}: {s['total_ms']:.1f} ms (random-select {s['random_select_ms']:.1f}, "
              f"search {s['search_ms']:.1f}; greedy capped at {s['max_lines']} lines, {s['lines_per_head']:.0f} taken)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(ARGS)
