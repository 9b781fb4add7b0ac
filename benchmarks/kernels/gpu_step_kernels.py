"""The decode step's own kernels on the GPU: turnkv/model/triton against the torch ops.

1. Checks every kernel against torch on the GPU (max relative error).
2. Skinny matmul for Llama-3.1-8B's projections at M = 1..16 rows, beside F.linear (cuBLAS) and
   F.linear with cuBLASLt preferred: achieved GB/s = weight bytes / time, and the fraction of the
   copy bandwidth measured here. Each timing replays a CUDA graph of back-to-back calls that rotate
   over copies of the weight (together > 256 MB, so L2 holds none of them), as the decode step reads
   its weights once.
3. Residual add + RMSNorm, RoPE and SiLU * up at T = 1 and T = 32768 against the torch ops they
   replace (torch: add_ + F.rms_norm; neg/cat/mul/addcmul; silu_ + mul_).
4. One whole decode step of the random-weight llama-3.1-8b (bf16, batch 1, context 4096) replayed
   from its CUDA graph with the kernels on and off (turnkv.model.ops.ENABLED), against the floor:
   weights + KV bytes over the copy bandwidth.

    python benchmarks/kernels/gpu_step_kernels.py --out benchmarks/kernels/results/h100_step_kernels.json         # ~2 min
    python benchmarks/kernels/gpu_step_kernels.py --sweep --out benchmarks/kernels/results/h100_gemv_sweep.json   # launch settings

--sweep times launch settings of the skinny matmul (tile sizes, warps, stages, split-K, tensor cores
or FMA) per shape and row count, prints the best per shape in turnkv/model/triton/gemv.py's TUNED
form, and the best single setting per row count over all shapes (for M1_CONFIG / MULTI_ROW_CONFIG).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from turnkv.bench import hardware
from turnkv.model import ops
from turnkv.model.config import rope_inverse_frequencies, shape_config
from turnkv.model.triton import activation, gemv, norm, rope

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import gpu_timing  # noqa: E402

# Llama-3.1-8B's projections (N, K) and how many of each a decode step runs.
SHAPES = [("qkv", 6144, 4096, 32), ("o_proj", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
          ("down_proj", 4096, 14336, 32), ("lm_head", 128256, 4096, 1)]
ROWS = (1, 2, 4, 8, 16)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
L2_DEFEAT_BYTES = 256 << 20
DTYPE = torch.bfloat16
ELEMENTWISE_TOKENS = (1, 32768)
# CUDA; "cpu" (with TRITON_INTERPRET=1 and small shapes) only to smoke-test this script's own code.
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --- timing ----------------------------------------------------------------------------------------


def time_graphed(fns: list, calls: int = 24, repeat: int = 20) -> float:
    """Per-call seconds of `calls` calls cycling through fns, replayed from one CUDA graph: the median of
    `repeat` replays after 3 (benchmarks/gpu_timing.py; gemv_sweep.py times with it too)."""
    return gpu_timing.time_graphed(fns, calls, repeat, warmup=3, device=DEVICE)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


class BlasLt:
    """F.linear with cuBLASLt preferred, for the duration of a capture or call."""

    def __enter__(self):
        self.before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")

    def __exit__(self, *exc):
        torch.backends.cuda.preferred_blas_library(self.before)


def weight_copies(N, K) -> list[torch.Tensor]:
    dtype = DTYPE
    count = max(2, math.ceil(L2_DEFEAT_BYTES / (N * K * torch.finfo(dtype).bits // 8)))
    return [torch.randn(N, K, device=DEVICE, dtype=dtype) * 0.02 for _ in range(count)]


# --- 1. correctness --------------------------------------------------------------------------------


def rope_tables(T: int, dtype=None):
    """cos/sin [1, T, 1, D] as Transformer.rope makes them for llama-3.1-8b (fp64, then rounded)."""
    dtype = dtype or DTYPE
    inv_freq = rope_inverse_frequencies(shape_config("llama-3.1-8b")).double().to(DEVICE)
    angles = torch.arange(T, device=DEVICE).double()[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_correctness() -> list[dict]:
    rows = []

    def record(name, err, tol):
        rows.append(dict(check=name, rel_err=err, tol=tol, ok=err < tol))
        print(f"  {'ok ' if err < tol else 'BAD'} {name:58s} rel err {err:.2e} (< {tol:.0e})", flush=True)

    torch.manual_seed(0)
    for name, N, K, _ in SHAPES:
        w = torch.randn(N, K, device=DEVICE, dtype=DTYPE) * 0.02
        for M in (1, 4, 8):
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            record(f"skinny {name} M={M} bf16", rel_err(gemv.skinny_matmul(x, w), F.linear(x.float(), w.float())), 1e-2)
    N, K = 6144, 4096
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2), (DTYPE, 1e-2)):
        w = torch.randn(N, K, device=DEVICE, dtype=dtype) * 0.02
        b = torch.randn(N, device=DEVICE, dtype=dtype)
        for M in (1, 3):
            x = torch.randn(M, K, device=DEVICE, dtype=dtype)
            ref = F.linear(x.double(), w.double(), b.double())
            for label, config in (("default", None), ("fma", gemv.FMA_CONFIG),
                                  ("split-k 4", dict(gemv.MULTI_ROW_CONFIG, block_n=64, block_k=128, num_stages=3, split_k=4)),
                                  ("fma split-k 3", dict(gemv.FMA_CONFIG, split_k=3))):
                out = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
                gemv.skinny_matmul(x, w, b, out=out, config=config)
                err = float("inf") if out.isnan().any() else rel_err(out, ref)
                record(f"skinny qkv+bias {label} M={M} {str(dtype)[6:]}", err, tol)
    # down_proj reads the strided gate half of gate/up's output
    w = torch.randn(HIDDEN, INTERMEDIATE, device=DEVICE, dtype=DTYPE) * 0.02
    wide = torch.randn(2, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE)
    record("skinny down_proj strided rows M=2", rel_err(gemv.skinny_matmul(wide[:, :INTERMEDIATE], w),
                                                        F.linear(wide[:, :INTERMEDIATE].float(), w.float())), 1e-2)

    for T in (1, 4096):
        for dtype, tol in ((DTYPE, 1e-2), (torch.float32, 1e-5)):
            x = torch.randn(T, HIDDEN, device=DEVICE, dtype=dtype)
            res = torch.randn(T, HIDDEN, device=DEVICE, dtype=dtype)
            w = torch.rand(HIDDEN, device=DEVICE, dtype=dtype) + 0.5
            expected_res = res + x
            ref = F.rms_norm(expected_res.double(), (HIDDEN,), w.double(), 1e-5)
            out = norm.add_rms_norm(x, res, w, 1e-5)
            record(f"add_rms_norm T={T} {str(dtype)[6:]}", max(rel_err(out, ref), rel_err(res, expected_res)), tol)

            qkv = torch.randn(1, T, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
            cos, sin = rope_tables(T, dtype)
            ref = ops.apply_rope(qkv[:, :, : HEADS + KV_HEADS].double(), cos.double(), sin.double())
            v = qkv[:, :, HEADS + KV_HEADS:].clone()
            out = rope.rope_in_place(qkv, HEADS + KV_HEADS, cos, sin)
            ok = torch.equal(qkv[:, :, HEADS + KV_HEADS:], v)
            record(f"rope in place T={T} {str(dtype)[6:]}", rel_err(out, ref) if ok else float("inf"), tol)

            gate_up = torch.randn(T, 2 * INTERMEDIATE, device=DEVICE, dtype=dtype)
            gate, up = gate_up.double().split(INTERMEDIATE, -1)
            ref = F.silu(gate) * up
            record(f"silu_mul T={T} {str(dtype)[6:]}", rel_err(activation.silu_mul_in_place(gate_up, INTERMEDIATE), ref), tol)
    return rows


# --- 2. skinny matmul against cuBLAS ---------------------------------------------------------------


def time_projection(N, K, M, copies, bw) -> dict:
    x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
    nbytes = N * K * 2
    row = dict(N=N, K=K, M=M, weight_mb=nbytes / 1e6)
    t = time_graphed([lambda w=w: gemv.skinny_matmul(x, w) for w in copies])
    row["triton_us"] = t * 1e6
    if M == 1:
        t = time_graphed([lambda w=w: gemv.skinny_matmul(x, w, config=gemv.FMA_CONFIG) for w in copies])
        row["triton_fma_us"] = t * 1e6
    row["cublas_us"] = time_graphed([lambda w=w: F.linear(x, w) for w in copies]) * 1e6
    try:
        with BlasLt():
            row["cublaslt_us"] = time_graphed([lambda w=w: F.linear(x, w) for w in copies]) * 1e6
    except Exception as e:  # noqa: BLE001 (a build without cuBLASLt's path)
        row["cublaslt_us"] = float("nan")
        print("  cublaslt:", type(e).__name__, str(e)[:120])
    for key in [k for k in row if k.endswith("_us")]:
        name = key[:-3]
        row[f"{name}_gbs"] = nbytes / (row[key] * 1e-6) / 1e9
        row[f"{name}_of_copy"] = nbytes / (row[key] * 1e-6) / bw
    return row


def bench_projections(bw) -> list[dict]:
    rows = []
    print(f"{'proj':10s} {'M':>3s} {'triton us':>9s} {'GB/s':>6s} {'of copy':>7s} {'fma us':>7s} {'cuBLAS us':>9s} "
          f"{'GB/s':>6s} {'cuBLASLt us':>11s} {'GB/s':>6s} {'speedup':>7s}")
    for name, N, K, _ in SHAPES:
        copies = weight_copies(N, K)
        for M in ROWS:
            row = dict(proj=name, **time_projection(N, K, M, copies, bw))
            rows.append(row)
            best_blas = min(row["cublas_us"], row["cublaslt_us"]) if row["cublaslt_us"] == row["cublaslt_us"] else row["cublas_us"]
            print(f"{name:10s} {M:3d} {row['triton_us']:9.1f} {row['triton_gbs']:6.0f} {row['triton_of_copy']:7.2f} "
                  f"{row.get('triton_fma_us', float('nan')):7.1f} {row['cublas_us']:9.1f} {row['cublas_gbs']:6.0f} "
                  f"{row['cublaslt_us']:11.1f} {row['cublaslt_gbs']:6.0f} {best_blas / row['triton_us']:7.2f}", flush=True)
        del copies
        torch.cuda.empty_cache()
    return rows


# --- 3. fused elementwise kernels --------------------------------------------------------------------


def time_add_rms_norm(T, calls) -> dict:
    x = torch.randn(T, HIDDEN, device=DEVICE, dtype=DTYPE)
    res = torch.randn(T, HIDDEN, device=DEVICE, dtype=DTYPE)
    w = torch.ones(HIDDEN, device=DEVICE, dtype=DTYPE)
    fused = time_graphed([lambda: norm.add_rms_norm(x, res, w, 1e-5)], calls)
    plain = time_graphed([lambda: F.rms_norm(res.add_(x), (HIDDEN,), w, 1e-5)], calls)
    return dict(op="add_rms_norm", T=T, fused_us=fused * 1e6, torch_us=plain * 1e6, bytes=5 * T * HIDDEN * 2)


def time_rope(T, calls) -> dict:
    qkv = torch.randn(1, T, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    cos, sin = rope_tables(T)
    n = HEADS + KV_HEADS
    fused = time_graphed([lambda: rope.rope_in_place(qkv, n, cos, sin)], calls)
    plain = time_graphed([lambda: ops.apply_rope(qkv[:, :, :n], cos, sin)], calls)
    return dict(op="rope", T=T, fused_us=fused * 1e6, torch_us=plain * 1e6, bytes=2 * T * n * HEAD_DIM * 2)


def time_silu_mul(T, calls) -> dict:
    gate_up = torch.randn(T, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE)

    def torch_silu_mul():
        gate, up = gate_up.split(INTERMEDIATE, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    fused = time_graphed([lambda: activation.silu_mul_in_place(gate_up, INTERMEDIATE)], calls)
    plain = time_graphed([torch_silu_mul], calls)
    return dict(op="silu_mul", T=T, fused_us=fused * 1e6, torch_us=plain * 1e6, bytes=3 * T * INTERMEDIATE * 2)


def bench_elementwise() -> list[dict]:
    rows = []
    print(f"{'op':14s} {'T':>6s} {'fused us':>9s} {'torch us':>9s} {'speedup':>7s} {'fused GB/s':>10s}")
    for T in ELEMENTWISE_TOKENS:
        calls = 48 if T == 1 else 6
        for timing in (time_add_rms_norm, time_rope, time_silu_mul):
            r = timing(T, calls)
            r["speedup"] = r["torch_us"] / r["fused_us"]
            r["fused_gbs"] = r["bytes"] / (r["fused_us"] * 1e-6) / 1e9
            print(f"{r['op']:14s} {r['T']:6d} {r['fused_us']:9.1f} {r['torch_us']:9.1f} {r['speedup']:7.2f} "
                  f"{r['fused_gbs']:10.0f}", flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    return rows


# --- 4. one whole decode step --------------------------------------------------------------------------


def bench_decode_step(bw, context=4096, e2e_steps=64) -> dict:
    from turnkv.engine.llm import LLM
    from turnkv.kv.sequence import SequenceKV

    llm = LLM(model="llama-3.1-8b", dtype=DTYPE, kv_memory="4GiB")
    runner, graphs = llm.runner, llm.runner.graphs
    assert graphs is not None, "decode must replay from CUDA graphs"
    model = llm.model
    # `turnkv bench speed` counts every parameter; a step reads one row of the embedding table, so
    # the strict floor leaves it out.
    all_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    c = llm.config
    seq = SequenceKV(llm.pool)
    ids = torch.randint(0, c.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        tok = runner.prefill(seq, ids).argmax(-1).view(1)
        result = dict(context=context, weight_gb=weight_bytes / 1e9)
        step_graphs, e2e = {}, {}
        for mode, enabled in (("fused", True), ("torch", False)):
            ops.ENABLED = enabled
            graphs.graphs.clear()  # the next step captures its graph with this setting
            for _ in range(3):
                tok = runner.decode([seq], tok).argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(e2e_steps):
                tok = runner.decode([seq], tok).argmax(-1)
            sync()
            e2e[mode] = (time.perf_counter() - start) / e2e_steps
            step_graphs[mode] = graphs.graphs.pop(1)  # kept: (graph, logits, step)
        ops.ENABLED = True
        # Both graphs read the same static buffers: replaying them in turn times the same step.
        logits = {}
        for mode, (graph, out, _) in step_graphs.items():
            graph.replay()
            logits[mode] = out.clone()
        times = {mode: [] for mode in step_graphs}
        for _ in range(3):
            for mode, (graph, _, _) in step_graphs.items():
                times[mode].append(gpu_timing.time_cuda(graph.replay, repeat=20, warmup=3, device=DEVICE))
        kv_bytes = seq.bytes()
        floor = hardware.decode_bytes(weight_bytes, kv_bytes) / bw
        speed_floor = hardware.decode_bytes(all_weight_bytes, kv_bytes) / bw
        for mode in step_graphs:
            t = min(times[mode])
            result[f"{mode}_step_ms"] = t * 1e3
            result[f"{mode}_of_floor"] = t / floor
            result[f"{mode}_of_speed_floor"] = t / speed_floor
            result[f"{mode}_e2e_ms"] = e2e[mode] * 1e3
        result["floor_ms"] = floor * 1e3
        result["speed_floor_ms"] = speed_floor * 1e3
        result["kv_gb"] = kv_bytes / 1e9
        result["gain_ms"] = result["torch_step_ms"] - result["fused_step_ms"]
        result["logits_rel_err"] = rel_err(logits["fused"], logits["torch"])
        result["same_argmax"] = bool((logits["fused"].argmax(-1) == logits["torch"].argmax(-1)).all())
    finally:
        ops.ENABLED = True
        seq.free()
    print(f"decode step, llama-3.1-8b bf16, batch 1, context {context} (graph replay): "
          f"fused {result['fused_step_ms']:.3f} ms ({result['fused_of_floor']:.2f}x floor), "
          f"torch {result['torch_step_ms']:.3f} ms ({result['torch_of_floor']:.2f}x floor), floor {result['floor_ms']:.3f} ms, "
          f"gain {result['gain_ms']:.3f} ms/step; against `bench speed`'s floor (embedding included, "
          f"{result['speed_floor_ms']:.3f} ms): fused {result['fused_of_speed_floor']:.2f}x, torch {result['torch_of_speed_floor']:.2f}x")
    print(f"  end to end (runner.decode, host included): fused {result['fused_e2e_ms']:.3f} ms, torch {result['torch_e2e_ms']:.3f} ms;"
          f" logits fused vs torch rel err {result['logits_rel_err']:.2e}, same argmax {result['same_argmax']}")
    return result


# --- sweep -----------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "step_kernels.json"),
                    help="JSON file to write")
    ap.add_argument("--sweep", action="store_true", help="time launch settings of the skinny matmul instead")
    ap.add_argument("--sweep-rows", default="1,4", help="row counts M for --sweep")
    ap.add_argument("--sweep-shapes", default=",".join(s[0] for s in SHAPES), help="projections for --sweep")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="compile processes for --sweep")
    ap.add_argument("--context", type=int, default=4096, help="context of the whole-step timing")
    ap.add_argument("--skip-step", action="store_true", help="skip the whole decode step (needs ~20 GB)")
    args = ap.parse_args()
    start = time.perf_counter()
    bw = hardware.copy_bandwidth(torch.device(DEVICE))  # as `turnkv bench speed` measures its floor
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}  SMs {props.multi_processor_count}  copy bandwidth {bw / 1e12:.2f} TB/s  "
          f"torch {torch.__version__}  triton {triton.__version__}", flush=True)
    report = dict(device=props.name, copy_bandwidth=bw, torch=torch.__version__, triton=triton.__version__)
    if args.sweep:
        from gemv_sweep import sweep  # beside this script

        report["sweep"] = sweep(bw, [int(m) for m in args.sweep_rows.split(",")], args.sweep_shapes.split(","),
                                args.workers)
    else:
        print("\n== correctness (GPU, against torch)")
        report["checks"] = check_correctness()
        print("\n== skinny matmul vs cuBLAS (bf16, in CUDA graphs, L2 defeated)")
        report["projections"] = bench_projections(bw)
        print("\n== fused elementwise kernels vs the torch ops they replace (bf16, in CUDA graphs)")
        report["elementwise"] = bench_elementwise()
        if not args.skip_step:
            print("\n== whole decode step")
            report["decode_step"] = bench_decode_step(bw, args.context)
        print_summary(report)
    report["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s)")


def print_summary(report):
    print("\n== summary")
    bad = [c["check"] for c in report["checks"] if not c["ok"]]
    print(f"checks: {len(report['checks']) - len(bad)}/{len(report['checks'])} within tolerance" +
          (f"; FAILED: {', '.join(bad)}" if bad else ""))
    # Per decode step at batch 1: every projection once per layer.
    counts = {name: n for name, _, _, n in SHAPES}
    m1 = [r for r in report["projections"] if r["M"] == 1]
    triton_ms = sum(r["triton_us"] * counts[r["proj"]] for r in m1) / 1e3
    cublas_ms = sum(r["cublas_us"] * counts[r["proj"]] for r in m1) / 1e3
    weight_ms = sum(r["weight_mb"] * 1e6 * counts[r["proj"]] for r in m1) / report["copy_bandwidth"] * 1e3
    print(f"{'proj':10s} {'M=1 triton':>10s} {'of copy':>7s} {'cuBLAS':>8s} {'of copy':>7s}")
    for r in m1:
        print(f"{r['proj']:10s} {r['triton_us']:8.1f}us {r['triton_of_copy']:7.2f} {r['cublas_us']:6.1f}us {r['cublas_of_copy']:7.2f}")
    print(f"projections of one step at M=1: triton {triton_ms:.2f} ms, cuBLAS {cublas_ms:.2f} ms, "
          f"weights over copy bandwidth {weight_ms:.2f} ms")
    for r in report["elementwise"]:
        print(f"{r['op']:14s} T={r['T']:<6d} fused {r['fused_us']:8.1f} us  torch {r['torch_us']:8.1f} us  x{r['speedup']:.2f}")
    step = report.get("decode_step")
    if step:
        print(f"decode step (8B, ctx {step['context']}): fused {step['fused_step_ms']:.3f} ms = {step['fused_of_floor']:.2f}x floor; "
              f"torch {step['torch_step_ms']:.3f} ms = {step['torch_of_floor']:.2f}x floor; target <= 1.25x "
              f"(with the embedding table in the floor as `bench speed` counts it: fused {step['fused_of_speed_floor']:.2f}x)")


if __name__ == "__main__":
    main()
