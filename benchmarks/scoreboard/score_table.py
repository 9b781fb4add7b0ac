"""The scoreboard's JSON as a markdown table, and that table put into a page between two marker lines
(docs/benchmarks.md shows the committed run's)."""

from __future__ import annotations

import re
from pathlib import Path

from score_claims import SERVING

UNITS = {"ttft_s": (1e3, "{:.1f} ms"), "tpot_s": (1e3, "{:.2f} ms"), "agreement": (1, "{:.3f}")}
BEGIN, END = "<!-- scoreboard: {} -->", "<!-- /scoreboard -->"


def _value(field: str, side: dict) -> str:
    if side["value"] is None:
        return "-"
    if field.endswith("bytes"):
        return f"{side['label']}: {_bytes(side['value'])}"
    scale, fmt = UNITS[field]
    return f"{side['label']}: {fmt.format(side['value'] * scale)}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= 0.1 * size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _x(cell: dict) -> str:
    if cell["x"] is None:
        return "- (" + cell.get("missing", "not measured") + ")"
    text = f"**{cell['x']:.2f}x**" if cell["met"] is False else f"{cell['x']:.2f}x"
    return text


def _goal(cell: dict) -> str:
    if cell["goal"] is None:
        return ""
    return f"{cell['goal_text']}: " + {True: "met", False: "**not met**", None: "-"}[cell["met"]]


def markdown(result: dict) -> str:
    """The table: per system its paper's claim (first row), then each cell's figure, turnkv's value, the
    value it is compared with from the same run (or the file named), how many times better, and the
    target where the project set one."""
    lines = ["| system | paper's claim | figure | turnkv | compared with | x better | target |",
             "|---|---|---|---|---|---|---|"]
    shown = set()
    for cell in result["cells"]:
        system = cell["system"]
        claim = result["claims"][system] if system not in shown else ""
        shown.add(system)
        figure = cell["figure"] + "".join(f" ({cell[k]})" for k in ("note", "source") if cell.get(k))
        lines.append(f"| {system if claim else ''} | {claim} | {figure} | {_value(cell['field'], cell['turnkv'])} | "
                     f"{_value(cell['field'], cell['baseline'])} | {_x(cell)} | {_goal(cell)} |")
    hw = result["hardware"]
    weights = " (random weights)" if result.get("weights") == "random" else ""
    lines += ["", f"{hw['device']}, {result['model']}{weights}, {result['dtype']}; copy bandwidth "
                  f"{hw['copy_bandwidth'] / 1e9:.4g} GB/s, matmul {hw['matmul_rate'] / 1e12:.3g} TFLOP/s measured in "
                  f"the run; {result['wall_s']:.0f} s in all (the JSON names the code it ran).",
              f"Command: `{result['command']}`", "",
              "Serving at capacity (through `turnkv serve`, too long for the scoreboard), committed:"]
    lines += [f"- {what}: `{path}`" for what, path in SERVING.items()]
    return "\n".join(lines) + "\n"


def put_in_page(page: Path, json_path: str, table: str) -> None:
    """Replace the page's scoreboard block (its marker lines and what lies between) with `table`
    between markers naming `json_path`; ValueError when the page has no such block."""
    text = page.read_text()
    if _BLOCK.search(text) is None:
        raise ValueError(f"{page} has no lines {BEGIN.format('<json>')!r} ... {END!r} to put the table between")
    page.write_text(_BLOCK.sub(lambda _: f"{BEGIN.format(json_path)}\n{table}{END}", text, count=1))


def shown_in_page(page: Path) -> tuple[str, str] | None:
    """(the JSON path the page's scoreboard block names, the table in it), or None without a block."""
    match = _BLOCK.search(page.read_text())
    return None if match is None else (match.group(1), match.group(2))


_BLOCK = re.compile(re.escape(BEGIN).replace(r"\{\}", r"(\S+)") + r"\n(.*?)" + re.escape(END), re.DOTALL)
