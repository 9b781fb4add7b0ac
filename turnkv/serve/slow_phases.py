"""The worker's phases in /metrics, and a log line for each one over SLOW_PHASE_S: every running
stream waited for it. The line says what the step carried (the scheduler's note), which Triton
kernels it compiled (turnkv/triton_compiles.py), the usual cause of a one-off stall, and the worker
thread's CPU time in it: a phase far longer than its CPU time waited, for the device or for the GIL
(another thread of the process running Python). thread_cpu_seconds() gives each thread's total, and
TURNKV_WORKER_PROFILE=path writes a cProfile of the worker thread to `path` when it stops."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from turnkv import triton_compiles
from turnkv.serve import worker_trace

log = logging.getLogger("turnkv.serve")

SLOW_PHASE_S = 0.25  # the worker_phase metric's over-250-ms bucket


def watch() -> None:
    triton_compiles.watch()


@contextlib.contextmanager
def timed(metrics, phase: str, work: bool, running):
    """Observe the phase's seconds when it had `work` to do. running() -> (decoding, prefilling, note),
    read after the phase."""
    start, cpu_start = time.perf_counter(), time.thread_time()
    triton_compiles.take()
    with worker_trace.phase(phase):  # labelled in a TURNKV_WORKER_TRACE window
        yield
    if not work:
        return
    seconds = time.perf_counter() - start
    metrics.labels(metrics.worker_seconds, phase).observe(seconds)
    if seconds > SLOW_PHASE_S:
        decoding, prefilling, note = running()
        compiled = triton_compiles.take()
        if compiled:
            note += f"; compiled {len(compiled)} Triton kernel(s): {', '.join(sorted(set(compiled)))}"
        note += f"; worker CPU {(time.thread_time() - cpu_start) * 1000:.0f} ms"
        log.info("slow %s phase: %.0f ms, %d decoding, %d prefilling%s", phase, seconds * 1000, decoding,
                 prefilling, note)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each live Python thread of this process, by thread name; empty
    where /proc does not say (not Linux)."""
    import os
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        out[thread.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


@contextlib.contextmanager
def profiled_worker():
    """cProfile over the block (the worker thread's loop) when TURNKV_WORKER_PROFILE names a file."""
    import os
    path = os.environ.get("TURNKV_WORKER_PROFILE")
    if not path:
        yield
        return
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(path)
        log.info("worker profile written to %s", path)
