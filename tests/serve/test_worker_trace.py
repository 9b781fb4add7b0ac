"""TURNKV_WORKER_TRACE: a torch.profiler window over the worker's loop, with each phase's host and
device time; alone and through a running server."""

import gzip
import json

import httpx
import pytest
import torch

from tests.serve.conftest import running
from turnkv.serve import worker_trace


def test_the_window_skips_then_traces_the_asked_iterations_by_phase(monkeypatch, tmp_path):
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", "2:3")
    trace = worker_trace.from_environment()
    trace.begin()
    for i in range(8):
        with worker_trace.phase("mixed"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        if i % 2:
            with worker_trace.phase("admit"):
                torch.ones(8).sum()
        trace.step()
    assert worker_trace._tracer is None  # closed after its 3 iterations: later phases go unlabelled
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    assert summary["iterations"] == 3
    assert summary["phases"]["mixed"]["count"] == 3  # iterations 2, 3, 4 of 0..7
    assert summary["phases"]["admit"]["count"] == 1  # only iteration 3 of those admitted
    assert summary["phases"]["mixed"]["host_ms"] > 0 and summary["wall_s"] > 0
    assert "aten::mm" in (tmp_path / "trace" / "ops_by_host.txt").read_text()
    with gzip.open(tmp_path / "trace" / "trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "worker.mixed" in names and "aten::mm" in names


def test_no_folder_no_trace_and_a_bad_window_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("TURNKV_WORKER_TRACE", raising=False)
    assert worker_trace.from_environment() is None
    assert isinstance(worker_trace.phase("mixed"), type(worker_trace.phase("admit")))  # both no-ops
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path))
    for bad in ("5", "a:b", "-1:3", "0:0"):
        monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", bad)
        with pytest.raises(ValueError, match="SKIP:ACTIVE"):
            worker_trace.from_environment()


def test_a_server_writes_its_window_when_it_stops_inside_it(serve_llm, monkeypatch, tmp_path):
    """The window is longer than the requests: the server's stop closes it and writes what it saw."""
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", "0:100000")
    with running(serve_llm, served_model_name="m") as server:
        for turn in range(2):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    assert summary["iterations"] > 0
    assert summary["phases"]["admit"]["count"] >= 2  # each request was admitted in the window
    assert summary["phases"]["decode"]["count"] + summary["phases"].get("mixed", {"count": 0})["count"] >= 2
