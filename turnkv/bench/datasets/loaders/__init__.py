"""Loaders for the public benchmark files a user may already have: LongBench, LoopServe's multi-turn
LongBench, Multi-IF, PrefEval and SCBench. Each reads one local file and returns `Instance`s; one
module per format, and `reading` for the file formats (JSON lines, JSON, CSV) and errors they share.

Conventions the loaders follow, which a quality runner must share:
- A turn whose reference is empty is not scored: it only puts something in the history (PrefEval's
  preference statement, its earlier chat). `reading.is_scored` says which turns count. Multi-IF turns
  have no reference text but are scored by their rule checks (metric "instructions").
- Metric names mean: "f1" token F1 and "rouge_l" Rouge-L against any of the references; "em" exact
  match after normalisation; "contains" the reference appears in the reply; "accuracy" the reply
  picks the reference label (a class name, a count, "Paragraph N", or an option letter A, B, ...).
- Multiple-choice questions carry their options in the question text, lettered A, B, ...; the
  reference is the letter.
- `depends_on` lists only earlier turns, never the turn itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.loaders.longbench import load_longbench
from turnkv.bench.datasets.loaders.loopserve import load_loopserve
from turnkv.bench.datasets.loaders.multi_if import load_multi_if
from turnkv.bench.datasets.loaders.prefeval import load_prefeval
from turnkv.bench.datasets.loaders.reading import DatasetError
from turnkv.bench.datasets.loaders.scbench import load_scbench
from turnkv.bench.datasets.schema import Instance
from turnkv.paths import user_path

__all__ = ["FORMATS", "load"]

FORMATS: dict[str, Callable[..., list[Instance]]] = {
    "longbench": load_longbench, "loopserve": load_loopserve, "multi_if": load_multi_if,
    "prefeval": load_prefeval, "scbench": load_scbench,
}


def load(format: str, path: str | Path, **options: Any) -> list[Instance]:
    """Load `path` with the loader named `format` (longbench, loopserve, multi_if, prefeval,
    scbench; case, '-' and spaces do not matter); `options` go to that loader."""
    key = re.sub(r"[\s\-]+", "_", str(format).strip().lower())
    key = {"multiif": "multi_if", "longbench_e": "longbench"}.get(key, key)
    if key not in FORMATS:
        raise DatasetError(f"unknown dataset format {format!r} (known: {', '.join(FORMATS)})")
    return FORMATS[key](user_path(path), **options)
