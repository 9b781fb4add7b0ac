"""SCBench (microsoft/SCBench scbench_<task>.jsonl: id, context, multi_turns [{input, answer,
options?, task?}])."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.loaders.reading import DatasetError, Where, iter_records, multiple_choice, parse_answer
from turnkv.bench.datasets.schema import Instance, Turn


# task -> metric, after SCBench's own scorers: retrieval tasks check the value is in the reply,
# choice_eng the option letter, mf the number, summary Rouge-L. repoqa (a similarity threshold on
# the reproduced function there) uses Rouge-L as the nearest turnkv metric.
SCBENCH_METRICS: dict[str, str] = {
    "kv": "contains", "kv_hard": "contains", "kv_compressible": "contains", "prefix_suffix": "contains",
    "hashhop": "contains", "passkey": "contains", "vt": "contains", "many_shot": "contains",
    "qa_eng": "contains", "qa_chn": "f1", "choice_eng": "accuracy", "mf": "em", "summary": "rouge_l",
    "repoqa": "rouge_l", "summary_with_needles": "rouge_l", "repoqa_and_kv": "rouge_l",
}

_SCBENCH_SYSTEM = {
    "kv": "Find the value for the key you are asked about in the JSON object. Reply with the value only.",
    "kv_hard": "Find the value for the key you are asked about in the JSON object. Reply with the value only.",
    "choice_eng": "Read the book and answer the questions about it.",
    "qa_eng": "Read the book and answer the questions about it. Be concise.",
    "qa_chn": "Read the book and answer the questions about it. Be concise.",
    "repoqa": "Find the function described in the code you are given and repeat it exactly, in a code block.",
}


def _scbench_name(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    low = name.strip().lower()
    for prefix in ("v2_", "scbench_", "multi_turn_"):
        if low.startswith(prefix):
            low = low[len(prefix):]
    return low if low in SCBENCH_METRICS else None


def load_scbench(path: str | Path, task: str | None = None) -> list[Instance]:
    """SCBench multi-turn: one instance per record. Turn 0 holds the shared `context` (or `input`,
    as SCBench's own loader allows; a list, as in scbench_mf, is written as JSON) and the first
    query; later turns hold only their query and depend on turn 0. The task (its metric in
    `SCBENCH_METRICS`) is `task`, else the file name (scbench_kv.jsonl, multi_turn_kv), else the
    record's `task`; a turn's own `task` (the mixed tasks) picks that turn's metric. Turns with
    `options` (choice_eng) become multiple choice with the answer's letter as the reference."""
    stem = Path(path).stem
    if task is not None and _scbench_name(task) is None:
        raise DatasetError(f"unknown SCBench task {task!r} (known: {', '.join(sorted(SCBENCH_METRICS))})", path)
    out = []
    for where, rec in iter_records(path):
        if not isinstance(rec, dict):
            raise where.error(f"expected a JSON object, got {type(rec).__name__}")
        short = _scbench_name(task) or _scbench_name(stem) or _scbench_name(rec.get("task"))
        if short is None:
            raise where.error(f"cannot tell the SCBench task from the file name {Path(path).name!r} or a "
                              f"'task' field; pass task= (known: {', '.join(sorted(SCBENCH_METRICS))})", "task")
        if rec.get("context") is not None:
            context = rec["context"]
        elif rec.get("input") is not None:
            context = rec["input"]
        else:
            raise where.error("record is missing required field 'context'", "context")
        if isinstance(context, list):
            context = json.dumps(context)
        if not isinstance(context, str):
            raise where.error("field 'context' must be text or a list", "context")
        multi = where.need(rec, "multi_turns", list)
        if not multi:
            raise where.error("field 'multi_turns' is empty", "multi_turns")
        turns = []
        for k, t in enumerate(multi):
            if not isinstance(t, dict):
                raise where.error(f"multi_turns[{k}] must be a JSON object", "multi_turns")
            if not isinstance(t.get("input"), str):
                raise where.error(f"multi_turns[{k}] is missing required field 'input'", "input")
            if t.get("answer") is None:
                raise where.error(f"multi_turns[{k}] is missing required field 'answer'", "answer")
            turn_task = _scbench_name(t.get("task")) or short
            metric, question = SCBENCH_METRICS[turn_task], t["input"]
            answer = parse_answer(t["answer"], where, "answer")
            if t.get("options") is not None:
                question, answer = _scbench_choice(t, answer, where, k)
                metric = "accuracy"
            turns.append(Turn(context=context if k == 0 else "", question=question, answer=answer,
                              position="end", depends_on=[0] if k else [], metric=metric))
        iid = str(rec["id"]) if rec.get("id") is not None else f"{stem}-{where.line}"
        out.append(Instance(task=f"scbench_{short}", id=iid, turns=turns, system=_SCBENCH_SYSTEM.get(short)))
    return out


def _scbench_choice(t: dict, answer: str | list[str], where: Where, k: int) -> tuple[str, str]:
    options = t["options"]
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
        raise where.error(f"multi_turns[{k}].options must list at least two options", "options")
    letters = string.ascii_uppercase[: len(options)]
    for a in answer if isinstance(answer, list) else [answer]:
        if a in options:
            return multiple_choice(t["input"], options, options.index(a), None)
        if a.strip().upper() in letters and len(a.strip()) == 1:
            return multiple_choice(t["input"], options, letters.index(a.strip().upper()), None)
    raise where.error(f"multi_turns[{k}].answer {answer!r} is neither an option nor an option letter", "answer")
