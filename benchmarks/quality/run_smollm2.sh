#!/usr/bin/env bash
# The committed SmolLM2-135M quality run: `turnkv bench quality --preset full`.
#   every task (5) x question position (3) x 3 turns of about 370 tokens, 48 new tokens a reply;
#   the core recipes (streaming-llm, h2o, snapkv, ada-snapkv) under recompress and flowkv at keep_ratio
#   0.2 and 0.5; the other evicting presets at both under recompress; every preset that does not evict
#   at two sizes scaled to these lengths (256 and 512 tokens per head; see turnkv/bench/quality_presets.py);
#   fidelity to the full cache (teacher forced) for every turn. 50 recipe settings, 765 conversations.
# Two worker processes split the recipes (one torch thread each on a 2-core machine); each runs the
# conversations of 16 recipes together with their decode steps batched (turnkv/bench/lockstep.py).
# Under an hour on 2 CPU cores. Resumable: rerun to continue from results.jsonl. Extra flags go to the
# command (e.g. --workers 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/quality/results/smollm2-hour}
TK=${TURNKV:-.venv/bin/turnkv}
start=$(date +%s)
echo "started $(date '+%Y-%m-%d %H:%M:%S')"
"$TK" bench quality --preset full --out "$OUT" "$@"
echo "finished $(date '+%Y-%m-%d %H:%M:%S'): $(( $(date +%s) - start )) s wall"
