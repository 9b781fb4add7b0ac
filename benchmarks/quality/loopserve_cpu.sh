#!/usr/bin/env bash
# CPU figures: LoopServe against the eviction and prefill-pattern baselines on SmolLM2-135M,
# on 3-turn conversations of about 4K tokens (about 1300 per turn) with the question at the Begin,
# Middle and End of each user turn. Budgets are B = 1024 tokens per KV head; the static patterns are
# scaled to the same size (A-shape/Tri-shape 128 sink + 1024 local, MInference 256 vertical +
# 1024 slash lines: their defaults are for 128K prompts and would be dense here).
# Per recipe and position: fidelity to the full run (agreement, KL), density, TTFT (report.md).
# Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/quality/loopserve-smollm2}
TK=${TURNKV:-.venv/bin/turnkv}
RECIPES="loopserve,loopserve-p,snapkv,ada-snapkv,streaming-llm"
RECIPES+=",prefill=a_shape(sink=128, local=1024),prefill=tri_shape(sink=128, local=1024, last=128)"
RECIPES+=",prefill=minference(vertical=256, slash=1024)"
"$TK" bench quality --tasks needle_qa,preferences --positions begin,middle,end --turns 3 --n 1 \
    --context-tokens 1300 --max-new-tokens 32 --seed 0 --budget 1024 --policies recompress \
    --recipes "$RECIPES" --out "$OUT" "$@"
