"""The scoreboard's cells: which measurements each system's headline needs (plan), and each cell's two
figures read from the run's own measurements and the ratio between them (cells).

A measurement is named by a key: "speed|<recipe>|<context>", "turn|<recipe>|<history>" or
"restore|<strategy>|<history>"; its row is result["measurements"][key]. A cell holds, for the system's
figure and its comparison ("turnkv" and "baseline"), the key, the row's field and the value read there;
"x" is how many times better the system's figure is (baseline / turnkv for times and bytes, turnkv /
baseline for agreement), "goal" the least x the target asks for (None: no target) and "met" whether
it holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from score_claims import CLAIMS, FLOWKV_RECIPES, FLOWKV_SOURCE

SYSTEMS = ("lserve", "loopserve", "adakv", "krul", "flowkv")
FULL, LSERVE, ADA = "full", "lserve-random", "ada-snapkv keep_ratio=0.1"
KRUL_STRATEGIES = ("full=gpu", "recompute", "krul")  # `gpu`: full's own state, offloaded and restored whole
LOWER = {"ttft_s", "tpot_s", "kv_bytes", "stored_bytes"}  # lower is better; agreement is higher


@dataclass(frozen=True)
class Settings:
    """What the cells are measured at: prompt lengths, the later turn's size and history, Krul's history."""

    contexts: tuple[int, ...]
    turn_tokens: int
    turn_history: int  # the later turns' kept history (score_measure.later_turn_history)
    krul_history: int

    @property
    def long(self) -> int:
        return max(self.contexts)


def speed_key(spec: str, ctx: int) -> str:
    return f"speed|{spec}|{ctx}"


def turn_key(spec: str, history: int) -> str:
    return f"turn|{spec}|{history}"


def restore_key(entry: str, history: int) -> str:
    return f"restore|{entry.split('=')[0]}|{history}"


def key(kind: str, spec: str, size: int) -> str:
    """The key of a planned measurement (kind, recipe or strategy, size)."""
    return {"speed": speed_key, "turn": turn_key, "restore": restore_key}[kind](spec, size)


def plan(systems: list[str], s: Settings) -> list[tuple[str, str, int]]:
    """(kind, recipe or strategy, size) of every measurement the systems' cells read, each once: the
    speed rows shortest context first (the full cache first at each), then the later turns, then the
    restores."""
    speed = []
    if "lserve" in systems:
        speed += [(spec, c) for c in s.contexts for spec in (FULL, LSERVE)]
    if "loopserve" in systems:
        speed += [(spec, s.long) for spec in (FULL, "loopserve-p", "loopserve", "loopserve-d")]
    if "adakv" in systems:
        speed += [(spec, s.long) for spec in (FULL, ADA)]
    out = [("speed", spec, c) for spec, c in sorted(dict.fromkeys(speed), key=lambda sc: (sc[1], sc[0] != FULL))]
    if "lserve" in systems:
        out += [("turn", spec, s.turn_history) for spec in (FULL, LSERVE)]
    if "krul" in systems:
        out += [("restore", entry, s.krul_history) for entry in KRUL_STRATEGIES]
    return out


def _tokens(n: int) -> str:
    return f"{n:,}"


def _cell(measured: dict, system: str, figure: str, field: str, mine: str, base: str, goal: float | None = None,
          goal_text: str = "", **extra) -> dict:
    """A cell comparing row `mine`'s `field` with row `base`'s, both from `measured` (a missing or
    unavailable row leaves the cell's values None and says why)."""
    cell = {"system": system, "figure": figure, "field": field, "goal": goal, "goal_text": goal_text, **extra}
    values = {}
    for side, key in (("turnkv", mine), ("baseline", base)):
        row = measured.get(key)
        value = None if row is None else row.get(field)
        cell[side] = {"key": key, "label": key.split("|")[1], "value": value}
        values[side] = value
        if row is None:
            cell.setdefault("missing", f"{key} was not measured")
        elif value is None:
            cell.setdefault("missing", f"{key}: {row.get('unavailable', 'no ' + field)}")
    a, b = values["turnkv"], values["baseline"]
    cell["x"] = None if not a or not b else (b / a if field in LOWER else a / b)
    cell["met"] = None if goal is None or cell["x"] is None else cell["x"] >= goal
    return cell


def cells(measured: dict, systems: list[str], s: Settings) -> list[dict]:
    """The cells of `systems`, in SYSTEMS' order, from this run's measurements."""
    out, long, n = [], s.long, s.krul_history
    if "lserve" in systems:
        for c in s.contexts:
            limit = 0.67 if c >= 65536 else 0.95  # the targets: 0.67x full's TTFT at 128K, 0.95x at 32K
            out.append(_cell(measured, "LServe", f"prefill TTFT, {_tokens(c)}-token prompt", "ttft_s",
                             speed_key(LSERVE, c), speed_key(FULL, c), 1 / limit, f"TTFT <= {limit}x full's"))
        out.append(_cell(measured, "LServe", f"{s.turn_tokens}-token later turn over {_tokens(s.turn_history)} "
                         "tokens kept, TTFT", "ttft_s", turn_key(LSERVE, s.turn_history),
                         turn_key(FULL, s.turn_history), 1.0, "no slower than full"))
        out.append(_cell(measured, "LServe", f"decode at {_tokens(long)} tokens, time per token", "tpot_s",
                         speed_key(LSERVE, long), speed_key(FULL, long), 1.8, ">= 1.8x full"))
    if "loopserve" in systems:
        for spec in ("loopserve-p", "loopserve"):
            out.append(_cell(measured, "LoopServe", f"{spec} prefill TTFT, {_tokens(long)}-token prompt", "ttft_s",
                             speed_key(spec, long), speed_key(FULL, long), 1 / 1.05, "TTFT <= 1.05x full's"))
        out.append(_cell(measured, "LoopServe", f"loopserve-d decode at {_tokens(long)} tokens, time per token",
                         "tpot_s", speed_key("loopserve-d", long), speed_key(FULL, long)))
    if "adakv" in systems:
        for figure, field in (("decode at {} tokens, time per token", "tpot_s"), ("KV held at {} tokens", "kv_bytes")):
            out.append(_cell(measured, "Ada-KV", "ada-snapkv keep 0.1, " + figure.format(_tokens(long)), field,
                             speed_key(ADA, long), speed_key(FULL, long)))
    if "krul" in systems:
        krul, full = restore_key("krul", n), restore_key("full", n)
        fallback = (measured.get(krul) or {}).get("fallback")
        # Without a plan that pays (random weights: no layer pairs), Krul stores the conversation as a
        # plainer strategy does; the cells say which.
        note = {"note": f"Krul stored it as {fallback}"} if fallback else {}
        out.append(_cell(measured, "Krul", f"restore of a {_tokens(n)}-token conversation from the CPU tier, TTFT, "
                         "against recomputing it", "ttft_s", krul, restore_key("recompute", n), **note))
        out.append(_cell(measured, "Krul", "the same against the full cache's own offload and restore", "ttft_s",
                         krul, full, 1.0, "no slower than full's restore", **note))
        out.append(_cell(measured, "Krul", f"KV stored for a {_tokens(n)}-token conversation", "stored_bytes", krul,
                         full, **note))
    if "flowkv" in systems:
        out.append(flowkv_cell())
    return out


def flowkv_cell(repo: Path = Path(__file__).resolve().parents[2]) -> dict:
    """FlowKV's cell, read from the committed quality run (not measured by the scoreboard): agreement with
    the full cache at the last turn, FlowKV's turn policy against re-compression."""
    summary = json.loads((repo / FLOWKV_SOURCE).read_text())
    last = max(r["turn"] for r in summary["by_turn_recipe"])
    rows = {r["recipe"]: r for r in summary["by_turn_recipe"] if r["turn"] == last}
    measured = {f"quality|{name}|turn {last + 1}": rows[name] for name in FLOWKV_RECIPES}
    mine, base = measured
    return _cell(measured, "FlowKV", f"agreement with the full cache at turn {last + 1} of {last + 1}, SnapKV "
                 "keeping 0.2, SmolLM2-135M, against re-compression", "agreement", mine, base,
                 source=f"from {FLOWKV_SOURCE}")


def claims(systems: list[str]) -> dict:
    names = {"lserve": "LServe", "loopserve": "LoopServe", "adakv": "Ada-KV", "krul": "Krul", "flowkv": "FlowKV"}
    return {names[s]: CLAIMS[names[s]] for s in systems}
