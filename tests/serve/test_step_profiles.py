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


def test_profile_compress_times_each_turns_compression(tmp_path, chat_model_dir):
    out = tmp_path / "compress.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/serving/profile_compress.py"), "--model",
                          str(chat_model_dir), "--dtype", "float32", "--device", "cpu", "--recipe",
                          "ada-snapkv keep_ratio=0.2 schedule=prompt", "--prompt", "300", "--turns", "3",
                          "--max-tokens", "2", "--kv-memory", "64MiB", "--out", str(out)],
                         check=True, timeout=600, capture_output=True, text=True)
    turns = json.loads(out.read_text())["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["prompt_tokens"] >= 300
    assert all(len(t["compressions"]) == 1 and t["compressions"][0]["seconds"] > 0 for t in turns)
    assert turns[1]["cached_tokens"] > 0  # the later turn reused the compressed history
    assert turns[0]["compressions"][0]["kept_tokens"] < 0.3 * turns[0]["prompt_tokens"] * 2 * 2  # 2 layers x 2 heads
    assert "--- host profile: compression 2 ---" in run.stdout


def test_step_profile_times_and_counts_the_servers_steps(tmp_path):
    """step_profile.py on CPU: a tiny random model, the full cache and LServe (its selection and the
    streaming heads' trim both running at this context), decode-only and mixed steps through the
    server's seam, with per-step ms, torch ops by name and host functions."""
    out = tmp_path / "steps.json"
    lserve = ("lserve-random decode=lserve(budget=64) "
              "prefill=streaming_heads(pattern=random,sink=16,local=32,prefill_local=64)")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/serving/step_profile.py"), "--model", "tiny",
                          "--dtype", "float32", "--device", "cpu", "--batch", "3", "--context", "160", "--slice", "32",
                          "--kv-memory", "16MiB", "--warmup", "1", "--steps", "2", "--profile-steps", "1",
                          "--recipes", f"full,{lserve}", "--out", str(out)],
                         check=True, timeout=600, capture_output=True, text=True)
    figures = json.loads(out.read_text())
    assert list(figures["recipes"]) == ["full", lserve] and figures["graph_batch"] is None
    for name, row in figures["recipes"].items():
        assert row["admitted"] == 3, name
        for kind in ("decode", "mixed"):
            step = row[kind]
            assert step["ms_per_step"] > 0 and len(step["ms"]) == 2
            assert step["torch_ops_per_step"] == sum(step["ops"].values()) > 0
            assert step["kernels_per_step"] == 0 and step["host"]
    assert "aten::linear" in figures["recipes"]["full"]["decode"]["ops"]
    assert f"--- {lserve}: mixed ---" in run.stdout
