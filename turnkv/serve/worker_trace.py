"""TURNKV_WORKER_TRACE=folder: torch.profiler over a window of the worker's loop, to tell the host's
time from the device's inside each phase. The window is TURNKV_WORKER_TRACE_WINDOW=SKIP:ACTIVE loop
iterations that had work (default 200:100); at its end the folder gets:

- summary.json: the window's wall seconds, the device's busy seconds (every kernel and copy, summed),
  and per phase (admit, prefill, decode, mixed) its count, wall (host) and device milliseconds;
- ops_by_host.txt, ops_by_device.txt: torch's op tables sorted by self host and self device time;
- trace.json.gz: the Chrome trace (chrome://tracing, Perfetto).

A phase's device time far below its wall time means the worker's host work held it up; close to it,
the device."""

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


def _device_us(event) -> float:
    return float(getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0))


def _self_device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


class WorkerTrace:
    def __init__(self, folder: str, skip: int, active: int):
        if skip < 0 or active < 1:
            raise ValueError(f"TURNKV_WORKER_TRACE_WINDOW wants SKIP:ACTIVE with SKIP >= 0, ACTIVE >= 1; "
                             f"got {skip}:{active}")
        self.folder, self.skip, self.active = folder, skip, active
        self.seen, self.started, self.done = 0, None, False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities)

    def begin(self) -> None:
        """The worker's loop starts (a window that skips nothing opens here)."""
        if self.skip == 0:
            self._open()

    def step(self) -> None:
        """One loop iteration that had work has ended."""
        if self.done:
            return
        self.seen += 1
        if self.started is None and self.seen == self.skip:
            self._open()
        elif self.started is not None and self.seen == self.skip + self.active:
            self.close()

    def _open(self) -> None:
        global _tracer
        self.profile.start()
        _tracer, self.started = self, time.perf_counter()

    def close(self) -> None:
        """End the window (also at the worker's end, if it is still open) and write the folder."""
        global _tracer
        if self.done or self.started is None:
            self.done = True
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profile.stop()
        _tracer, self.done = None, True
        self.write(wall)

    def write(self, wall: float) -> None:
        os.makedirs(self.folder, exist_ok=True)
        events = self.profile.key_averages()
        device = "self_device_time_total" if hasattr(events[0] if len(events) else None,
                                                     "self_device_time_total") else "self_cuda_time_total"
        with open(os.path.join(self.folder, "ops_by_host.txt"), "w") as f:
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=60))
        with open(os.path.join(self.folder, "ops_by_device.txt"), "w") as f:
            f.write(events.table(sort_by=device, row_limit=60))
        phases = {e.key[len(PHASE_PREFIX):]: {"count": e.count, "host_ms": e.cpu_time_total / 1000,
                                             "device_ms": _device_us(e) / 1000}
                  for e in events if e.key.startswith(PHASE_PREFIX)}
        summary = {"iterations": self.seen - self.skip, "wall_s": wall,
                   "device_busy_s": sum(_self_device_us(e) for e in events) / 1e6, "phases": phases}
        with open(os.path.join(self.folder, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        raw = os.path.join(self.folder, "trace.json")
        self.profile.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        log.info("worker trace written to %s: %.1f s of wall, device busy %.1f s", self.folder, wall,
                 summary["device_busy_s"])


def from_environment() -> WorkerTrace | None:
    folder = os.environ.get("TURNKV_WORKER_TRACE")
    if not folder:
        return None
    window = os.environ.get("TURNKV_WORKER_TRACE_WINDOW", "200:100")
    try:
        skip, active = (int(x) for x in window.split(":"))
    except ValueError:
        raise ValueError(f"TURNKV_WORKER_TRACE_WINDOW wants SKIP:ACTIVE (two integers), got {window!r}") from None
    return WorkerTrace(folder, skip, active)


def phase(name: str):
    """A label over one phase, in the trace while a window is open (nothing otherwise)."""
    if _tracer is None:
        return contextlib.nullcontext()
    return torch.profiler.record_function(PHASE_PREFIX + name)
