"""The matmul rate a floor is measured at, against the rate the GPU sustains, with its SM clock and
power sampled by nvidia-smi the whole time.

`turnkv bench speed` measures its prefill floor's matmul rate as the median of ten 8192^3 bf16 GEMMs,
each synchronised (turnkv.bench.hardware.matmul_rate): a burst. A prefill runs matmuls and attention
for seconds. This script times the same burst, then 8192^3 GEMMs back to back for --seconds (20 per
CUDA-event sample), then the prefill's gate/up projection shape ([32768, 4096] x [4096, 28672]) for
--seconds, then the burst again; nvidia-smi samples clocks.sm, power.draw and the clock event reasons
(0x4: the software power cap) every 200 ms.

    python benchmarks/prefill/matmul_sustained.py --out benchmarks/prefill/results/h100-matmul-sustained
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from turnkv.bench.hardware import matmul_rate  # noqa: E402

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def sustained(m: int, k: int, n: int, seconds: float, device) -> list[float]:
    """TFLOP/s of x [m, k] @ w.T [k, n], one sample per 20 back-to-back calls, for `seconds`."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    rates = []
    end_at = time.time() + seconds
    while time.time() < end_at:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            x @ w.t()
        end.record()
        end.synchronize()
        rates.append(20 * 2 * m * k * n / (start.elapsed_time(end) / 1e3) / 1e12)
    return rates


def summary(rates: list[float]) -> dict:
    s = sorted(rates)
    return dict(samples=len(s), min=s[0], p25=s[len(s) // 4], median=s[len(s) // 2], p75=s[3 * len(s) // 4],
                max=s[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    with open(out / "smi.csv", "w") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv", "-lms", "200"],
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
            result["burst_before"] = [matmul_rate(device, torch.bfloat16) / 1e12 for _ in range(3)]
            time.sleep(2)
            result["square_8192"] = summary(sustained(8192, 8192, 8192, args.seconds, device))
            time.sleep(2)
            result["gate_up_32768"] = summary(sustained(32768, 4096, 28672, args.seconds, device))
            time.sleep(2)
            result["burst_after"] = [matmul_rate(device, torch.bfloat16) / 1e12 for _ in range(3)]
        finally:
            smi.terminate()
    (out / "matmul_sustained.json").write_text(json.dumps(result, indent=1))
    print("TFLOP/s, burst (turnkv's floor):", " ".join(f"{r:.0f}" for r in result["burst_before"]), "|",
          " ".join(f"{r:.0f}" for r in result["burst_after"]))
    for name in ("square_8192", "gate_up_32768"):
        r = result[name]
        print(f"{name} for {args.seconds:.0f} s: min {r['min']:.0f} p25 {r['p25']:.0f} median {r['median']:.0f} "
              f"p75 {r['p75']:.0f} max {r['max']:.0f} ({r['samples']} samples)")
    rows = [line.split(", ") for line in (out / "smi.csv").read_text().splitlines()[1:] if line.count(",") >= 4]
    busy = [r for r in rows if float(r[2].split()[0]) > 300]  # samples under load (> 300 W)
    if busy:
        clocks = sorted(int(r[1].split()[0]) for r in busy)
        capped = sum(int(r[4], 16) & 0x4 != 0 for r in busy)
        print(f"under load ({len(busy)} samples): SM clock {clocks[0]}-{clocks[-1]} MHz, median "
              f"{clocks[len(clocks) // 2]}; power cap active in {capped}")


if __name__ == "__main__":
    main()
