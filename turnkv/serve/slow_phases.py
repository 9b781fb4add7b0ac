"""The worker's phases in /metrics, and a log line for each one over SLOW_PHASE_S: every running
stream waited for it. The line says what the step carried (the scheduler's note) and which Triton
kernels it compiled (turnkv/triton_compiles.py), the usual cause of a one-off stall."""

from __future__ import annotations

import contextlib
import logging
import time

from turnkv import triton_compiles

log = logging.getLogger("turnkv.serve")

SLOW_PHASE_S = 0.25  # the worker_phase metric's over-250-ms bucket


def watch() -> None:
    triton_compiles.watch()


@contextlib.contextmanager
def timed(metrics, phase: str, work: bool, running):
    """Observe the phase's seconds when it had `work` to do. running() -> (decoding, prefilling, note),
    read after the phase."""
    start = time.perf_counter()
    triton_compiles.take()
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
        log.info("slow %s phase: %.0f ms, %d decoding, %d prefilling%s", phase, seconds * 1000, decoding,
                 prefilling, note)
