"""The text `turnkv methods` prints: every registered component with its parameters, or the presets,
wrapped to a terminal's width. `--json` prints the rows themselves (registry.describe, presets)."""

from __future__ import annotations

import textwrap

from turnkv.methods.evict.eviction import SCHEDULES
from turnkv.methods.recipe import PRESET_DOCS, presets
from turnkv.methods.registry import describe


def preset_rows() -> dict[str, dict]:
    """{preset name: {"recipe": its recipe string, "about": its one-line description}}."""
    return {name: {"recipe": str(recipe), "about": PRESET_DOCS.get(name, "")} for name, recipe in presets().items()}


def presets_text(width: int) -> str:
    lines = []
    for name, row in preset_rows().items():
        lines += [wrapped(name, row["about"], 0, 25, width), wrapped("", row["recipe"], 0, 25, width)]
    return "\n".join(lines)


def methods_text(width: int) -> str:
    """Components by axis and kind, each with its docstring's first line and its parameters, then the
    eviction options and schedules."""
    lines, kind = [], None
    for row in describe():
        if row["kind"] != kind:
            kind = row["kind"]
            lines.append(f"\n[{kind}]" if kind == row["axis"] else f"\n[{row['axis']}: {kind}]")
        params = ", ".join(f"{k}={v!r}" for k, v in row["params"].items())
        lines.append(wrapped(row["name"], row["doc"], 2, 23, width))
        if params:
            lines.append(wrapped("", f"({params})", 2, 23, width))
    lines.append("\n[evict options] budget=N (tokens per KV head) | keep_ratio=F | compression_ratio=F | every=N")
    lines += [wrapped(f"schedule={name}", doc, 2, 23, width) for name, doc in SCHEDULES.items()]
    return "\n".join(lines)


def wrapped(name: str, text: str, indent: int, column: int, width: int) -> str:
    """`name` at `indent`, then `text` from `column`, wrapped to `width` with its lines aligned there."""
    head = " " * indent + name
    head = head + " " * (column - len(head)) if len(head) < column else head + "\n" + " " * column
    return textwrap.fill(text, width, initial_indent=head, subsequent_indent=" " * column, break_on_hyphens=False)
