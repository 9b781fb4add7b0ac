"""Launch settings of the decode over a selection's lists, end to end: LServe (streaming heads,
pattern=random) at 128K, batch 1, one process per setting (gpu_step_profile.py with --splits /
--block-n / --warps), each printing wall ms per step and the decode kernels' GPU time per step.
The default row ("default") is the engine's own choice. JSON per setting to $OUT/launch/.

    python benchmarks/sparse/gpu_selection_launch.py [--context 129536]     # H100: ~30 s a setting
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = [(None, None, None), (17, 32, 2), (33, 32, 2), (66, 32, 2), (66, 16, 2), (100, 16, 2), (33, 16, 2),
            (17, 16, 2), (33, 64, 4)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=129536)
    p.add_argument("--recipe", default="lserve")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/sparse/results")
    args = p.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for splits, block_n, warps in SETTINGS:
        name = "default" if splits is None else f"{splits}_{block_n}_{warps}"
        out = os.path.join(args.out, "launch", name)
        cmd = [sys.executable, os.path.join(here, "gpu_step_profile.py"), "--context", str(args.context),
               "--recipes", args.recipe, "--out", out]
        for flag, value in (("--splits", splits), ("--block-n", block_n), ("--warps", warps)):
            if value is not None:
                cmd += [flag, str(value)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "step_profile.json")) as f:
            row = json.load(f)["rows"][0]
        kernels = {k["name"]: k["us_per_step"] for k in row["kernels"]}
        rows.append((name, row["wall_us_per_step"], kernels.get("_decode_chunk", 0.0),
                     kernels.get("_merge_chunks", 0.0)))
        print(f"{name:10s} wall {rows[-1][1]:7.0f} us/step  decode kernel {rows[-1][2]:6.1f}  merge {rows[-1][3]:6.1f}",
              flush=True)


if __name__ == "__main__":
    main()
