"""The serving diagnostics run end to end on a tiny model: profile_steps.py (a batch's graphed,
eager and mixed steps, and a slice alone) and host_reserve.py (a decode step's page reservation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import save_tiny

REPO = Path(__file__).resolve().parents[2]


def test_profile_steps_times_every_kind_of_step(tmp_path):
    save_tiny(tmp_path / "tiny", "llama", max_position_embeddings=16384)
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/serving/profile_steps.py"), "--model",
                          str(tmp_path / "tiny"), "--dtype", "float32", "--device", "cpu", "--recipe",
                          "ada-snapkv keep_ratio=0.5 schedule=prompt", "--batch", "3", "--prompt", "200",
                          "--slice", "32", "--kv-memory", "64MiB", "--steps", "1", "--out", str(out)],
                         check=True, timeout=600, capture_output=True, text=True)
    figures = json.loads(out.read_text())
    assert figures["batch"] == 3 and figures["graph_batch"] == 3  # no CUDA graphs: one batch
    assert 0 < figures["kept_tokens_per_head"] < 200  # the prompts were compressed
    for name in ("graphed_decode_s", "eager_decode_s", "mixed_step_s", "slice_alone_s"):
        assert figures[name] > 0, name
    assert "--- host profile: mixed step ---" in run.stdout


def test_host_reserve_reports_a_step():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/serving/host_reserve.py"), "--streams", "4",
                          "--layers", "2", "--kv-heads", "2", "--history", "400", "--steps", "3"],
                         check=True, timeout=300, capture_output=True, text=True)
    assert run.stdout.startswith("4 streams x 2 layers x 2 KV heads: ") and "ms of host time" in run.stdout
