#!/usr/bin/env bash
# The committed SmolLM2-135M quality run (issue #5), in three cumulative stages into one folder.
# Each stage is a resume of the previous one with more recipes or budgets (results.jsonl is keyed by
# instance x position x recipe), so a run stopped at any point leaves complete, comparable slices:
#   1. the core recipes at keep_ratio 0.2;  2. the same at 0.5 as well;
#   3. every other preset at 0.2 under recompress;  4. the same at 0.5.
# Rerun this script to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/quality/smollm2-full}
TK=${TURNKV:-.venv/bin/turnkv}
CORE="streaming-llm,h2o,snapkv,ada-snapkv"
# flowkv and flowkv-ada-snapkv are left out: they are snapkv / ada-snapkv under --policies flowkv.
OTHERS="pyramidkv,tova,knorm,expected-attention,random,ada-pyramidkv,ada-expected-attention,loopserve-p,loopserve"
# a-shape, tri-shape, minference and loopserve-d are left out: at these lengths (under 1K tokens) their
# defaults (4096 local keys, 1000 + 6096 lines, a 1024-token decode budget) cover everything, so they
# equal the full cache. benchmarks/loopserve_cpu.sh runs them at 4K tokens with patterns scaled to fit.
COMMON=(--tasks needle_qa,kv_retrieval,preferences,instructions,fewshot --positions begin,middle,end
        --turns 3 --n 1 --context-tokens 300 --max-new-tokens 48 --seed 0 --out "$OUT")
"$TK" bench quality "${COMMON[@]}" --policies recompress,flowkv --recipes "$CORE" --keep-ratio 0.2
"$TK" bench quality "${COMMON[@]}" --policies recompress,flowkv --recipes "$CORE" --keep-ratio 0.2,0.5
# Labels: "name@policy@ratio", except that a lone recompress policy is left out ("pyramidkv@0.2").
"$TK" bench quality "${COMMON[@]}" --policies recompress --recipes "$OTHERS" --keep-ratio 0.2
"$TK" bench quality "${COMMON[@]}" --policies recompress --recipes "$OTHERS" --keep-ratio 0.5
