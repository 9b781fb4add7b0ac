"""LoopServe's multi-turn LongBench (turns with begin/middle/end prompts, ground truth and
dependent_turn_indices; the public file layout is not published, see load_loopserve)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.loaders.longbench import LONGBENCH_KINDS, metric_for
from turnkv.bench.datasets.loaders.reading import DatasetError, Where, iter_records, parse_answer
from turnkv.bench.datasets.schema import POSITIONS, Instance, Turn


def _depends(value: Any, k: int, where: Where, field: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise where.error(f"field {field!r} of turn {k} must be a list of turn indices", field)
    bad = [i for i in value if i < 0 or i > k]
    if bad:
        raise where.error(f"field {field!r} of turn {k} names turns {bad} that do not come before it", field)
    return sorted({i for i in value if i < k})


def load_loopserve(path: str | Path, positions: Iterable[str] = POSITIONS,
                   metrics: dict[str, str] | None = None) -> list[Instance]:
    """LoopServe's benchmark: each record is one conversation, given either as a list of turns or as
    an object with `turns` (or `multi_turn_data`) and optionally `dataset`/`task` and `id`/`_id`.

    A turn has its reference in `ground_truth` (or `answer`/`answers`), its dependencies in
    `dependent_turn_indices` (or `depends_on`), and its text either as `prompts`
    {"begin", "middle", "end"} (the rendered user message for each position) or as `context` +
    `question` (turnkv places the question). Each record gives one instance per position, with id
    "<id>-<position>", record by record. The dataset name (a LongBench name or LoopServe's short one
    such as NQA or MFQA-en; from `dataset`/`task`, else the file name) picks the metric."""
    positions = list(positions)
    for pos in positions:
        if pos not in POSITIONS:
            raise DatasetError(f"position {pos!r} is not one of {POSITIONS}", path)
    stem = Path(path).stem
    out = []
    for where, rec in iter_records(path):
        if isinstance(rec, list):
            turns_data, name, rid = rec, stem, None
            name_field = "file name"
        elif isinstance(rec, dict):
            key = "turns" if "turns" in rec else "multi_turn_data" if "multi_turn_data" in rec else None
            if key is None:
                raise where.error("record is missing required field 'turns'", "turns")
            turns_data = where.need(rec, key, list)
            name = rec.get("dataset") or rec.get("task") or stem
            name_field = "dataset" if rec.get("dataset") else "task" if rec.get("task") else "file name"
            rid = rec.get("id", rec.get("_id"))
        else:
            raise where.error(f"expected a JSON object or a list of turns, got {type(rec).__name__}")
        if not turns_data:
            raise where.error("the conversation has no turns", "turns")
        dataset, metric, kind = metric_for(str(name), where, name_field, metrics)
        rid = str(rid) if rid is not None else f"{stem}-{where.line}"

        per_position: dict[str, list[Turn]] = {pos: [] for pos in positions}
        rendered = None
        for k, t in enumerate(turns_data):
            if not isinstance(t, dict):
                raise where.error(f"turn {k} must be a JSON object, got {type(t).__name__}", "turns")
            answer_key = next((a for a in ("ground_truth", "answer", "answers") if t.get(a) is not None), None)
            if answer_key is None:
                raise where.error(f"turn {k} is missing required field 'ground_truth'", "ground_truth")
            answer = parse_answer(t[answer_key], where, answer_key)
            dep_key = "dependent_turn_indices" if "dependent_turn_indices" in t else "depends_on"
            depends = _depends(t.get(dep_key), k, where, dep_key)
            has_prompts = t.get("prompts") is not None
            if rendered is None:
                rendered = has_prompts
            elif rendered != has_prompts:
                raise where.error(f"turn {k} mixes 'prompts' with 'context'/'question' turns", "prompts")
            for pos in positions:
                if has_prompts:
                    prompts = t["prompts"]
                    if not isinstance(prompts, dict) or not isinstance(prompts.get(pos), str):
                        raise where.error(f"turn {k} is missing required field 'prompts.{pos}'", f"prompts.{pos}")
                    context, question = "", prompts[pos]
                else:
                    if not isinstance(t.get("question"), str):
                        raise where.error(f"turn {k} is missing required field 'question' (or 'prompts')", "question")
                    context, question = t.get("context") or "", t["question"]
                    if not isinstance(context, str):
                        raise where.error(f"field 'context' of turn {k} must be a string", "context")
                per_position[pos].append(Turn(context=context, question=question, answer=answer, position=pos,
                                              depends_on=list(depends), metric=metric))
        system = None if rendered else LONGBENCH_KINDS[kind][0]
        for pos in positions:
            out.append(Instance(task=dataset, id=f"{rid}-{pos}", turns=per_position[pos], system=system))
    return out
