"""The Python heap of a process that keeps one engine to its end (the CLI's chat, generate, serve and
bench speed).

Loading an engine leaves a few hundred thousand Python objects that live as long as the process (the
tokenizer's vocabulary, the model's modules, the kernels' caches). CPython's collector scans all of
them in every full pass, which comes every few thousand steps and stalls the step it lands in for
tens to hundreds of milliseconds. `freeze()` collects once, then moves every object alive into the
permanent generation, which the collector never scans again (gc.freeze).

Frozen objects are never collected, even once unreachable: call it only where the engine stays, not
in code that builds and drops engines (tests, notebooks).
"""

from __future__ import annotations

import gc


def freeze() -> int:
    """Collect, then leave every object alive out of later passes; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
