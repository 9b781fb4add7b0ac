"""What each paper claims, in a line of our own words, and the committed files the scoreboard points to
rather than measures (serving at capacity takes far longer than the scoreboard's ten minutes)."""

from __future__ import annotations

CLAIMS = {
    "LServe": "prefill up to 2.9x and decode 1.3-2.1x faster than vLLM: half the heads become streaming "
              "heads that read only their sink and local blocks (abstract)",
    "LoopServe": "an online vertical/slash search sparsifies each prompt's prefill and a progressive selection "
                 "shrinks decode's reads; its prefill-only variant has the lowest latency (latency ablation)",
    "Ada-KV": "adaptive per-head budgets keep decode latency and memory at SnapKV's level at the same budget, "
              "well below the full cache's (section 4.4)",
    "Krul": "restoring a conversation takes 1.5-2.68x less time to first token and stores 1.33-2.35x less KV "
            "than state-of-the-art restoration (abstract)",
    "FlowKV": "compressing only the latest turn keeps later turns' instruction following far above "
              "re-compressing the whole history (10.9% to 75.4%, abstract)",
}

# FlowKV's figure is quality on real weights: teacher-forced agreement with the full cache's next token at
# the last of three turns, SnapKV keeping 0.2, FlowKV's turn policy against re-compression.
FLOWKV_SOURCE = "benchmarks/quality/results/smollm2-hour/summary.json"
FLOWKV_RECIPES = ("snapkv@flowkv@0.2", "snapkv@recompress@0.2")

# Serving at capacity through `turnkv serve` (benchmarks/serving/capacity_bench.py), committed beside its command.
SERVING = {
    "32 users x 16K with the server's warm-up, full / lserve / full-krul":
        "benchmarks/serving/results/capacity_h100_small_warm/results.json",
    "32 users x 16K, full / full-krul / no-reuse": "benchmarks/serving/results/capacity_h100_small_a/results.json",
    "32 users x 16K, ada-snapkv / flowkv / lserve": "benchmarks/serving/results/capacity_h100_small_b/results.json",
    "64 users x 32K, ada-snapkv": "benchmarks/serving/results/capacity_h100_ada-snapkv/results.json",
}
