"""The capacity benchmark's smoke path (benchmarks/serving/capacity_bench.py --smoke): it starts
`turnkv serve`, plays the workload through the openai client and writes every figure it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_results_table_and_plots(tmp_path, embedded_model):
    out = tmp_path / "capacity"
    subprocess.run([sys.executable, str(REPO / "benchmarks/serving/capacity_bench.py"), "--smoke",
                    "--configs", "ada-snapkv,full-sliced", "--out", str(out)], check=True, timeout=900)
    data = json.loads((out / "results.json").read_text())
    assert list(data["results"]) == ["ada-snapkv", "full-sliced"]
    users = data["workload"]["users"]
    for name, r in data["results"].items():
        assert r["failed"] == 0 and r["requests"] == sum(data["workload"]["turns"]), name
        assert r["output_tokens"] == 8 * r["requests"]  # ignore_eos: every reply is max_tokens long
        assert set(r["ttft_by_turn"]) >= {"1", "2", "3"}
        assert r["itl_p50_s"] > 0 and r["itl_p99_s"] >= r["itl_p50_s"]
        assert 0 < r["itl_server_p50_le_s"] <= r["itl_server_p99_le_s"]  # the worker's own histogram
        stalls = r["client_loop_stalls"]
        assert stalls["count"] == len(r["timeline"]["client_loop_lags"]) and stalls["longest_s"] >= 0
        assert r["tokens_reused"] > 0 and r["tokens_prefilled"] > 0
        assert r["kv_bytes_peak"] > 0
        kept = sum(r["conversations_end"].values()) + r["conversations_dropped"]
        assert kept >= users, name
        turns = r["timeline"]["turns"]
        assert len(turns) == r["requests"] - r["failed"]
        assert all(sent <= first <= end for _, _, sent, first, end in turns)
        # the report rounds each end to the millisecond, so a gap just over 250 ms may read 249 ms
        assert all(b - a > 0.25 - 0.0015 for a, b, _ in r["timeline"]["slow_gaps"])
        phases = r["worker_phases"]
        assert phases["mixed"]["count"] == r["mixed_steps"] and phases["finish"]["count"] == r["requests"], name
        assert phases["decode"]["count"] > 0 and phases["decode"]["seconds"] > 0, name
    assert data["results"]["full-sliced"]["mixed_steps"] == 0
    md = (out / "results.md").read_text()
    assert "| worker mixed: iterations / seconds / over 250 ms |" in md
    assert "| inter-token on the server (histogram bucket edges), p50 / p99 (ms) |" in md
    assert "| client event loop stalls over 100 ms: count / longest (ms) |" in md
    assert "| aggregate output tokens/s |" in md and "TTFT turn 2 p50 / p99 (ms)" in md
    assert (out / "capacity_ttft.png").stat().st_size > 0 and (out / "capacity_capacity.png").stat().st_size > 0


def test_tensor_parallel_reaches_the_server_command():
    """--tensor-parallel N starts each configuration's server on N ranks; N=1 adds no flag."""
    sys.path.insert(0, str(REPO / "benchmarks/serving"))
    import capacity_bench

    for n, expected in ((1, None), (2, "2")):
        args = SimpleNamespace(max_running=None, users=4, prefill_chunk=64, max_step_tokens=256, max_tokens=8,
                               model=None, dtype="float32", device="cpu", kv_memory="64MiB",
                               state_cpu_memory=None, tokenizer=None, tensor_parallel=n)
        cmd = capacity_bench.server_command(args, "full", 1234)
        got = cmd[cmd.index("--tensor-parallel") + 1] if "--tensor-parallel" in cmd else None
        assert got == expected
        assert cmd[-2:] == ["--recipe", "full"]
