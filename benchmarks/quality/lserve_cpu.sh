#!/usr/bin/env bash
# CPU figures: LServe and its baselines on SmolLM2-135M with the calibrated streaming-head
# pattern (the default of prefill=streaming_heads), on 3-turn conversations of about 3K tokens with
# the question at the Begin, Middle and End. Page selection is scaled to the context: 512 tokens per
# head (the 4096 default would read everything here). Streaming heads: sink 128 + local 256 (the
# defaults), prefill window 512. Then LServe's selection reuse interval 1, 2, 4, 8, 16.
# Fidelity to the full run (agreement, KL), KV bytes, TTFT: report.md. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/quality/lserve-smollm2}
TK=${TURNKV:-.venv/bin/turnkv}
STREAM="prefill=streaming_heads(prefill_local=512)"
RECIPES="decode=quest(budget=512),$STREAM,$STREAM decode=lserve(budget=512),decode=lserve(budget=512)"
for reuse in 1 2 8 16; do RECIPES+=",$STREAM decode=lserve(budget=512, reuse=$reuse)"; done
"$TK" bench quality --tasks needle_qa,preferences --positions begin,middle,end --turns 3 --n 1 \
    --context-tokens 1000 --max-new-tokens 32 --seed 0 --recipes "$RECIPES" --out "$OUT"
