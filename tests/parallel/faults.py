"""Faults the failure tests plant in a worker's engine through turnkv.parallel.mirror.gather (which
pickles these functions by name). Each leaves rank 0 alone."""

from __future__ import annotations

import os
import time


def exit_at_next_forward(engine) -> None:
    """The worker's process exits at its next forward, as a crashed rank would."""
    if engine.parallel.rank != 0:
        engine.model.forward = lambda *args, **kwargs: os._exit(3)


def hang_at_next_forward(engine) -> None:
    """The worker stops at its next forward for longer than any test, as a hung rank would."""
    if engine.parallel.rank != 0:
        engine.model.forward = lambda *args, **kwargs: time.sleep(3600)
