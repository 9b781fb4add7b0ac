"""`turnkv bench speed` under the engine's policy for cuDNN's per-shape plans, or under the one before
e300460 (cuDNN for every fresh chunk and for SDPA in every prefill step, the split from 2^25
new-token x history cells), for an A/B on one machine. bench speed gives every timed prefill lengths
no earlier call had, as a conversation does, so each plan's build is paid as users pay it.

    python benchmarks/prefill/cudnn_plan_policy_ab.py new OUT_DIR 8192,32768,129536
    python benchmarks/prefill/cudnn_plan_policy_ab.py old OUT_DIR 8192,32768,129536
    python benchmarks/prefill/cudnn_plan_policy_ab.py new OUT_DIR 32768 lserve-random   # other recipes

Run a first process before the timed ones: Triton caches its compiled kernels on disk, and the first
process on a fresh machine compiles them inside its timings.
"""

from __future__ import annotations

import sys

sys.path.insert(0, ".")
from turnkv.attention import chunk  # noqa: E402
from turnkv.cli import main  # noqa: E402

if __name__ == "__main__":
    policy, out, contexts = sys.argv[1:4]
    recipes = sys.argv[4] if len(sys.argv) > 4 else "full"
    if policy == "old":
        chunk.SPLIT_MIN_CELLS, chunk.CUDNN_MIN_ROWS = 1 << 25, 2
    elif policy != "new":
        raise SystemExit("policy: new or old")
    main(["bench", "speed", "--model", "llama-3.1-8b", "--dtype", "bfloat16", "--device", "cuda",
          "--contexts", contexts, "--new-tokens", "16", "--turns", "1", "--turn-tokens", "64,512,4096",
          "--recipes", recipes, "--peers", "none", "--repeat", "3", "--out", out])
