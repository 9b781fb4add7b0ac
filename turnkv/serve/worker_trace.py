"""TURNKV_WORKER_TRACE=folder: torch.profiler over a window of the worker's loop, to tell the host's
time from the device's inside each phase. The window is TURNKV_WORKER_TRACE_WINDOW=START:SECONDS,
seconds after the worker starts (default 60:5; the window opens and closes between loop iterations).
At its end the folder gets:

- summary.json: the window's wall seconds and the device's busy seconds in it; per phase (admit,
  prefill, decode, mixed, finish) its count, wall milliseconds, the device's busy milliseconds while
  it ran (kernels and copies of every stream, overlaps counted once) and the milliseconds the worker
  spent in calls that wait for the device (synchronize, blocking copies); and the slowest phases one
  by one, with their top-level host ops;
- ops_by_host.txt, ops_by_device.txt: torch's op tables sorted by self host and self device time;
- trace.json.gz: the Chrome trace (chrome://tracing, Perfetto).

A phase whose device was busy for most of it waited for the device; one whose device sat idle, and
whose worker was not waiting in a synchronizing call, was held up by the worker's own host work."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import time

import torch

log = logging.getLogger("turnkv.serve")

PHASE_PREFIX = "worker."
_tracer = None  # the active WorkerTrace, if any: phase() labels only while one runs


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Runtime calls in which the host waits for the device.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SLOWEST = 20


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _clip(spans, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if s < hi and e > lo]


def phase_times(events: list[dict]) -> dict:
    """From a Chrome trace's events: the device's busy seconds, and per phase (the worker.* ranges)
    its wall, device-busy and device-wait milliseconds; the SLOWEST phases one by one."""
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                    if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    phases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
             and str(e.get("name", "")).startswith(WAITS)]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")]
    totals, each = {}, []
    for p in phases:
        lo, hi = p["ts"], p["ts"] + p.get("dur", 0)
        same_thread = [e for e in waits if e.get("tid") == p.get("tid")]
        row = {"phase": p["name"][len(PHASE_PREFIX):], "wall_ms": (hi - lo) / 1000,
               "device_busy_ms": _union_us(_clip(device, lo, hi)) / 1000,
               "device_wait_ms": _union_us(_clip([(e["ts"], e["ts"] + e.get("dur", 0)) for e in same_thread],
                                                 lo, hi)) / 1000,
               "_span": (lo, hi, p.get("tid"))}
        each.append(row)
        t = totals.setdefault(row["phase"], {"count": 0, "wall_ms": 0.0, "device_busy_ms": 0.0,
                                             "device_wait_ms": 0.0})
        t["count"] += 1
        for key in ("wall_ms", "device_busy_ms", "device_wait_ms"):
            t[key] += row[key]
    slowest = sorted(each, key=lambda r: -r["wall_ms"])[:SLOWEST]
    for row in slowest:
        lo, hi, tid = row.pop("_span")
        row["top_host_ops"] = _top_level(ops, lo, hi, tid)
    for row in each:
        row.pop("_span", None)
    return {"device_busy_s": _union_us(device) / 1e6, "phases": totals, "slowest": slowest}


def _top_level(ops: list[dict], lo: float, hi: float, tid, limit: int = 8) -> list[dict]:
    """The host ops of one thread inside [lo, hi] that no other op there contains, summed by name."""
    inside = sorted((e for e in ops if e.get("tid") == tid and e["ts"] >= lo and e["ts"] + e.get("dur", 0) <= hi),
                    key=lambda e: (e["ts"], -e.get("dur", 0)))
    by_name, reach = {}, float("-inf")
    for e in inside:
        if e["ts"] < reach:
            continue  # nested in the last top-level op
        reach = e["ts"] + e.get("dur", 0)
        row = by_name.setdefault(e["name"], [0, 0.0])
        row[0] += 1
        row[1] += e.get("dur", 0) / 1000
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:limit]
    return [{"op": name, "count": n, "ms": ms} for name, (n, ms) in top]


class WorkerTrace:
    def __init__(self, folder: str, start_s: float, active_s: float):
        if start_s < 0 or active_s <= 0:
            raise ValueError(f"TURNKV_WORKER_TRACE_WINDOW wants START:SECONDS with START >= 0, SECONDS > 0; "
                             f"got {start_s}:{active_s}")
        self.folder, self.start_s, self.active_s = folder, start_s, active_s
        self.seen, self.began, self.started, self.done = 0, None, None, False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities)

    def begin(self) -> None:
        """The worker's loop starts: the window's START counts from here."""
        self.began = time.perf_counter()
        if self.start_s == 0:
            self._open()

    def step(self) -> None:
        """One loop iteration has ended."""
        if self.done or self.began is None:
            return
        now = time.perf_counter()
        if self.started is None and now - self.began >= self.start_s:
            self._open()
        elif self.started is not None:
            self.seen += 1
            if now - self.started >= self.active_s:
                self.close()

    def _open(self) -> None:
        global _tracer
        self.profile.start()
        _tracer, self.started = self, time.perf_counter()
        log.info("worker trace window open for %.1f s", self.active_s)

    def close(self) -> None:
        """End the window (also at the worker's end, if it is still open) and write the folder."""
        global _tracer
        if self.done or self.started is None:
            self.done = True
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        _tracer, self.done = None, True
        try:
            self.profile.stop()
            self.write(wall)
        except Exception:  # a diagnostic: its failure must not take the server down with it
            log.exception("could not write the worker trace to %s", self.folder)

    def write(self, wall: float) -> None:
        os.makedirs(self.folder, exist_ok=True)
        events = self.profile.key_averages()
        device = "self_device_time_total" if hasattr(events[0] if len(events) else None,
                                                     "self_device_time_total") else "self_cuda_time_total"
        with open(os.path.join(self.folder, "ops_by_host.txt"), "w") as f:
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=60))
        with open(os.path.join(self.folder, "ops_by_device.txt"), "w") as f:
            f.write(events.table(sort_by=device, row_limit=60))
        raw = os.path.join(self.folder, "trace.json")
        self.profile.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        summary = {"iterations": self.seen, "wall_s": wall, **phase_times(trace.get("traceEvents", []))}
        with open(os.path.join(self.folder, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        log.info("worker trace written to %s: %.1f s of wall, device busy %.1f s", self.folder, wall,
                 summary["device_busy_s"])


def from_environment() -> WorkerTrace | None:
    folder = os.environ.get("TURNKV_WORKER_TRACE")
    if not folder:
        return None
    window = os.environ.get("TURNKV_WORKER_TRACE_WINDOW", "60:5")
    try:
        start, active = (float(x) for x in window.split(":"))
    except ValueError:
        raise ValueError(f"TURNKV_WORKER_TRACE_WINDOW wants START:SECONDS (two numbers), got {window!r}") from None
    return WorkerTrace(folder, start, active)


def phase(name: str):
    """A label over one phase, in the trace while a window is open (nothing otherwise)."""
    if _tracer is None:
        return contextlib.nullcontext()
    return torch.profiler.record_function(PHASE_PREFIX + name)
