"""TURNKV_WORKER_TRACE: a torch.profiler window over the worker's loop, with each phase's wall, device
busy and device wait time; the arithmetic on a synthetic trace, the window alone and through a server."""

import gzip
import json

import httpx
import pytest
import torch

from tests.serve.conftest import running
from turnkv.serve import worker_trace


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def test_phase_times_count_device_busy_once_and_the_workers_waits():
    events = [
        _x("worker.mixed", "user_annotation", 0, 1000),
        _x("worker.admit", "user_annotation", 2000, 500),
        # kernels of two streams overlapping inside mixed: busy 100..400 and 300..600 -> 500 us
        _x("k1", "kernel", 100, 300, tid=7), _x("k2", "kernel", 300, 300, tid=8),
        _x("copy", "gpu_memcpy", 900, 200, tid=9),  # half inside mixed (900..1000)
        _x("k3", "kernel", 2100, 50, tid=7),  # inside admit
        _x("aten::mm", "cpu_op", 10, 80), _x("aten::addmm", "cpu_op", 20, 30),  # nested: not top level
        _x("aten::mm", "cpu_op", 200, 100),
        _x("cudaStreamSynchronize", "cuda_runtime", 400, 250),
        _x("cudaStreamSynchronize", "cuda_runtime", 450, 10, tid=2),  # another thread's wait
        _x("cudaLaunchKernel", "cuda_runtime", 700, 5),
    ]
    out = worker_trace.phase_times(events)
    assert out["device_busy_s"] == pytest.approx((500 + 200 + 50) / 1e6)
    mixed, admit = out["phases"]["mixed"], out["phases"]["admit"]
    assert mixed == {"count": 1, "wall_ms": 1.0, "device_busy_ms": pytest.approx(0.6), "device_wait_ms": 0.25}
    assert admit == {"count": 1, "wall_ms": 0.5, "device_busy_ms": pytest.approx(0.05), "device_wait_ms": 0.0}
    slowest = out["slowest"][0]
    assert slowest["phase"] == "mixed"
    assert slowest["top_host_ops"] == [
        {"op": "cudaStreamSynchronize", "count": 1, "ms": 0.25},
        {"op": "aten::mm", "count": 2, "ms": 0.18},
        {"op": "cudaLaunchKernel", "count": 1, "ms": 0.005}]


def test_the_window_writes_its_phases_and_later_phases_go_unlabelled(monkeypatch, tmp_path):
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", "0:1000")
    trace = worker_trace.from_environment()
    trace.begin()
    for i in range(4):
        with worker_trace.phase("mixed"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        if i % 2:
            with worker_trace.phase("admit"):
                torch.ones(8).sum()
        trace.step()
    trace.close()
    assert worker_trace._tracer is None and isinstance(worker_trace.phase("mixed"), type(worker_trace.phase("x")))
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    assert summary["iterations"] == 4
    assert summary["phases"]["mixed"]["count"] == 4 and summary["phases"]["admit"]["count"] == 2
    assert summary["phases"]["mixed"]["wall_ms"] > 0 and summary["wall_s"] > 0
    mixed = next(row for row in summary["slowest"] if row["phase"] == "mixed")
    assert "aten::matmul" in [op["op"] for op in mixed["top_host_ops"]]  # aten::mm is nested in it
    assert "aten::mm" in (tmp_path / "trace" / "ops_by_host.txt").read_text()
    with gzip.open(tmp_path / "trace" / "trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "worker.mixed" in names and "aten::mm" in names


def test_a_window_not_yet_open_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", "3600:5")
    trace = worker_trace.from_environment()
    trace.begin()
    trace.step()
    trace.close()
    assert worker_trace._tracer is None and not (tmp_path / "trace").exists()


def test_no_folder_no_trace_and_a_bad_window_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("TURNKV_WORKER_TRACE", raising=False)
    assert worker_trace.from_environment() is None
    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path))
    for bad in ("5", "a:b", "-1:3", "0:0"):
        monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", bad)
        with pytest.raises(ValueError, match="START:SECONDS"):
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
    steps = sum(summary["phases"].get(p, {"count": 0})["count"] for p in ("prefill", "decode", "mixed"))
    assert steps >= 2 and summary["phases"]["admit"]["wall_ms"] > 0


def test_a_bad_window_stops_the_server_at_its_start(serve_llm, monkeypatch, tmp_path):
    """Read when the worker starts, in the app's start-up: the server does not come up, and says why
    (it never runs with a dead worker)."""
    import asyncio

    from turnkv.serve import ServeConfig, create_app

    monkeypatch.setenv("TURNKV_WORKER_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TURNKV_WORKER_TRACE_WINDOW", "soon")
    app = create_app(serve_llm, ServeConfig(served_model_name="m"))

    async def start():
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ValueError, match="TURNKV_WORKER_TRACE_WINDOW wants START:SECONDS .* got 'soon'"):
        asyncio.run(start())
