"""How much a selecting decode's speed depends on where the pool put its pages: LServe (streaming heads,
pattern=random) at 32K, Llama-3.1-8B shape with random weights in bf16, through LLM.generate, in a pool
sized as `turnkv bench speed` sizes it for 128K. The same 32K prompt runs on a fresh pool, again, after
a full-cache 128K conversation came and went (its pages back on the free stacks), and after the free
stacks were sorted (low page ids handed out first) and shuffled. ms per token over the steps that made tokens
16..63, with dense 32K rows on the sorted and the shuffled stacks. JSON to $OUT/page_layout.json.

    python benchmarks/sparse/gpu_page_layout.py     # H100: ~1 min
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
import turnkv  # noqa: E402
from turnkv.bench.speed import steady_time_per_token  # noqa: E402

LSERVE = "lserve prefill=streaming_heads(pattern=random)"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main():
    need = 129536 + 64 + 16

    def kv_memory(config, dtype):  # as `turnkv bench speed --contexts 129536` sizes it
        return int(need * config.kv_bytes_per_token(dtype.itemsize) * 1.1) + (64 << 20)

    llm = turnkv.LLM("llama-3.1-8b", dtype="bfloat16", device="cuda", max_model_len=need + 16, kv_memory=kv_memory)
    p32, p128 = prompt(32768, 0), prompt(129536, 0)
    rows = []

    def run(recipe, tokens, label, new_tokens=64, timed=True):
        reply = llm.generate(tokens, recipe=recipe, max_new_tokens=new_tokens, ignore_eos=True)
        if timed:
            ms = steady_time_per_token(reply, 16) * 1e3
            rows.append({"case": label, "recipe": recipe, "context": len(tokens), "ms_per_token": ms})
            print(f"{label:36s} {ms:6.3f} ms/token", flush=True)

    run(LSERVE, p32[:4096], "warm-up (captures)", timed=False)
    run(LSERVE, p32, "lserve 32K, fresh pool")
    run(LSERVE, p32, "lserve 32K, again")
    run("full", p128, "full 128K (fills the pool)", new_tokens=2, timed=False)
    run(LSERVE, p32, "lserve 32K, after full 128K")
    run(LSERVE, p32, "lserve 32K, again")
    pool = llm.pool
    gen = np.random.default_rng(0)

    def reorder(how: str) -> None:
        for layer in range(pool.num_layers):
            top = pool._top[layer]
            free = np.sort(pool._stack[layer, :top])[::-1]  # low ids on top of each free stack
            pool._stack[layer, :top] = free if how == "sorted" else gen.permutation(free)

    reorder("sorted")
    run(LSERVE, p32, "lserve 32K, free stacks sorted")
    run("full", p32, "full 32K, free stacks sorted")
    for i in range(2):
        reorder("shuffled")
        run(LSERVE, p32, f"lserve 32K, free stacks shuffled ({i + 1})")
    run("full", p32, "full 32K, free stacks shuffled")
    out = os.environ.get("OUT") or "benchmarks/sparse/results"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "page_layout.json"), "w") as f:
        json.dump({"command": "python benchmarks/sparse/gpu_page_layout.py", "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
