"""The MLP of a long prefill with its elementwise work fused into the GEMMs' epilogues (quack-kernels,
which flash-attn-4 installs), against cuBLAS and turnkv's fused kernels, one layer at the
Llama-3.1-8B shape in bf16.

- gate/up: cuBLAS `x @ W_gu^T`, then turnkv's SiLU * up kernel over the gate half, against quack's
  GEMM with the SwiGLU epilogue (`gemm_act(activation="swiglu", concat_layout=("B",))`, [gate; up]
  as turnkv stores them), which writes only the [M, I] product;
- down: cuBLAS `h @ W_d^T` against quack's plain GEMM, and against quack's GEMM that adds into the
  residual stream in its epilogue (`gemm_add_inplace`);
- quack's plain GEMM on the gate/up shape, to see its GEMM apart from the epilogue.

Each with quack's default config (tuned=False) and autotuned (tuned=True; its first call tries the
configs). Median of --repeat CUDA-event timings after a warm-up; the outputs against cuBLAS's.

    python benchmarks/prefill/mlp_epilogue.py --rows 4096,32768 --out results/h100-mlp-epilogue.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from turnkv.model import ops  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336


def timed(fn, repeat: int) -> float:
    """Median ms of fn() over `repeat` CUDA-event timings, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()  # as the engine runs: turnkv's fused kernels are off while autograd records
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4096,32768")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tuned", default="0,1", help="quack configs to try: 0 default, 1 autotuned")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from quack.gemm_interface import gemm, gemm_act, gemm_add_inplace

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w_gu = (torch.randn(2 * INTERMEDIATE, HIDDEN, device=dev, dtype=dt, generator=g) * HIDDEN**-0.5)
    w_d = (torch.randn(HIDDEN, INTERMEDIATE, device=dev, dtype=dt, generator=g) * INTERMEDIATE**-0.5)
    rows_out = []
    for M in (int(r) for r in args.rows.split(",")):
        x = torch.randn(M, HIDDEN, device=dev, dtype=dt, generator=g)
        resid = torch.randn(M, HIDDEN, device=dev, dtype=dt, generator=g)
        h = torch.randn(M, INTERMEDIATE, device=dev, dtype=dt, generator=g) * 0.1
        flops_gu, flops_d = 2 * M * HIDDEN * 2 * INTERMEDIATE, 2 * M * INTERMEDIATE * HIDDEN

        def turnkv_gate_up():
            return ops.silu_mul(x @ w_gu.t(), INTERMEDIATE)

        want_gu = turnkv_gate_up().clone()
        row = {"rows": M, "cublas_gate_up_silu_ms": timed(turnkv_gate_up, args.repeat),
               "cublas_gate_up_ms": timed(lambda: x @ w_gu.t(), args.repeat),
               "cublas_down_ms": timed(lambda: h @ w_d.t(), args.repeat)}
        want_d = h @ w_d.t()
        row["cublas_down_add_ms"] = timed(lambda: resid.add(h @ w_d.t()), args.repeat)
        for tuned in (bool(int(t)) for t in args.tuned.split(",")):
            tag = "tuned" if tuned else "default"
            acc = resid.clone()
            variants = {
                "gate_up_swiglu": (lambda: gemm_act(x, w_gu.t(), activation="swiglu", concat_layout=("B",),
                                                    store_preact=False, tuned=tuned)[1], want_gu),
                "gate_up": (lambda: gemm(x, w_gu.t(), tuned=tuned), None),
                "down": (lambda: gemm(h, w_d.t(), tuned=tuned), want_d),
                "down_add": (lambda: gemm_add_inplace(h, w_d.t(), acc, tuned=tuned), None),
            }
            for name, (fn, want) in variants.items():
                start = time.perf_counter()
                try:  # each on its own: one that fails to build leaves the others
                    got = fn()
                    torch.cuda.synchronize()
                    row[f"quack_{tag}_{name}_first_call_s"] = round(time.perf_counter() - start, 2)
                    if want is not None:
                        row[f"quack_{tag}_{name}_rel_err"] = rel_err(got, want)
                    row[f"quack_{tag}_{name}_ms"] = timed(fn, args.repeat)
                except Exception as error:  # noqa: BLE001 - report what failed, go on with the rest
                    row[f"quack_{tag}_{name}_error"] = repr(error)[:200]
        for key in [k for k in row if k.endswith("_ms")]:
            flops = flops_gu if "gate_up" in key else flops_d
            row[key.replace("_ms", "_tflops")] = round(flops / row[key] / 1e9, 1)
        rows_out.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
