"""LongBench (THUDM/LongBench jsonl: input, context, answers, length, dataset, language,
all_classes, _id)."""

from __future__ import annotations

import re
from pathlib import Path

from turnkv.bench.datasets.loaders.reading import Where, iter_records, parse_answer
from turnkv.bench.datasets.schema import METRICS, Instance, Turn


# dataset -> (metric, kind). Metrics follow LongBench's per-dataset table; the code tasks (scored by
# edit similarity there) use Rouge-L, the nearest metric turnkv has.
LONGBENCH_METRICS: dict[str, tuple[str, str]] = {
    "narrativeqa": ("f1", "qa"), "qasper": ("f1", "qa"), "multifieldqa_en": ("f1", "qa"),
    "multifieldqa_zh": ("f1", "qa"), "hotpotqa": ("f1", "qa"), "2wikimqa": ("f1", "qa"),
    "musique": ("f1", "qa"), "dureader": ("rouge_l", "qa"),
    "gov_report": ("rouge_l", "summary"), "multi_news": ("rouge_l", "summary"),
    "vcsum": ("rouge_l", "summary"), "qmsum": ("rouge_l", "query"),
    "trec": ("accuracy", "fewshot"), "lsht": ("accuracy", "fewshot"), "triviaqa": ("f1", "fewshot"),
    "samsum": ("rouge_l", "fewshot"),
    "passage_count": ("accuracy", "count"), "passage_retrieval_en": ("accuracy", "retrieval"),
    "passage_retrieval_zh": ("accuracy", "retrieval"),
    "lcc": ("rouge_l", "code"), "repobench-p": ("rouge_l", "code"),
}

# kind -> (system instruction, question used when the record's `input` is empty)
LONGBENCH_KINDS: dict[str, tuple[str, str | None]] = {
    "qa": ("Answer the question using the text you are given. Reply with the answer only, no other "
           "words.", None),
    "summary": ("Summarise the text you are given.", "Write a one-page summary of the text above."),
    "query": ("Answer the query using the transcript you are given, in one or more sentences.", None),
    "fewshot": ("Complete the last item the same way as the examples.", None),
    "count": ("Some paragraphs may be duplicates of others.",
              "How many unique paragraphs are there once duplicates are removed? Reply with the "
              "number only."),
    "retrieval": ("Find the paragraph the given abstract comes from. Reply in the form "
                  "\"Paragraph N\".", None),
    "code": ("Complete the code. Reply with the next line of code only.", "Write the next line of code."),
}

_ALIASES = {"nqa": "narrativeqa", "nrtvqa": "narrativeqa", "mfqaen": "multifieldqa_en",
            "mfqa": "multifieldqa_en", "mfen": "multifieldqa_en", "mfqazh": "multifieldqa_zh",
            "2wikimultihopqa": "2wikimqa", "2wikimqa": "2wikimqa", "multinews": "multi_news",
            "govreport": "gov_report", "pcount": "passage_count", "pre": "passage_retrieval_en",
            "rbp": "repobench-p"}


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_LONGBENCH_BY_SQUASHED = {_squash(k): k for k in LONGBENCH_METRICS} | _ALIASES


def _longbench_name(name: str) -> str | None:
    """The LongBench dataset a name refers to (LongBench-E's `_e` suffix and LoopServe's short
    names included), or None."""
    low = name.strip().lower()
    if low.endswith("_e") and _squash(low[:-2]) in _LONGBENCH_BY_SQUASHED:
        low = low[:-2]
    return _LONGBENCH_BY_SQUASHED.get(_squash(low))


def metric_for(name: str, where: Where, field: str, metrics: dict[str, str] | None) -> tuple[str, str, str]:
    """(dataset, metric, kind) for a LongBench-style dataset name."""
    dataset = _longbench_name(name)
    if dataset is None:
        known = ", ".join(sorted(LONGBENCH_METRICS))
        raise where.error(f"unknown LongBench dataset {name!r} (known: {known})", field)
    metric, kind = LONGBENCH_METRICS[dataset]
    if metrics:
        metric = metrics.get(dataset, metrics.get(name, metric))
    if metric not in METRICS:
        raise where.error(f"metric {metric!r} for {dataset} is not one of {METRICS}", field)
    return dataset, metric, kind


def load_longbench(path: str | Path, metrics: dict[str, str] | None = None) -> list[Instance]:
    """LongBench (v1 / LongBench-E) jsonl: one single-turn instance per record.

    `context` is the turn's context and `input` its question. Every LongBench prompt puts `input`
    after the context, so the position is "end" (move it with `Instance.with_position`). Where
    `input` is empty (summaries, passage count, lcc) the question is an instruction for the task.
    The metric comes from `dataset` (`LONGBENCH_METRICS`); `metrics` overrides it per dataset, e.g.
    {"samsum": "accuracy"} as LoopServe reports it. `_id` is the instance id. `length`, `language`
    and `all_classes` are read but have no place in an `Instance`."""
    out = []
    for where, rec in iter_records(path):
        question = where.need(rec, "input", str)
        context = where.need(rec, "context", str)
        answers = parse_answer(where.need(rec, "answers"), where, "answers")
        name = where.need(rec, "dataset", str)
        dataset, metric, kind = metric_for(name, where, "dataset", metrics)
        system, default_question = LONGBENCH_KINDS[kind]
        if not question.strip():
            if default_question is None:
                raise where.error(f"field 'input' is empty, and a {dataset} record needs a question", "input")
            question = default_question
        for optional, types in (("all_classes", (list, type(None))), ("length", (int, type(None)))):
            if optional in rec and not isinstance(rec[optional], types):
                raise where.error(f"field {optional!r} has the wrong type ({type(rec[optional]).__name__})", optional)
        iid = str(rec.get("_id") or f"{Path(path).stem}-{where.line}")
        turn = Turn(context=context, question=question, answer=answers, position="end", metric=metric)
        out.append(Instance(task=dataset, id=iid, turns=[turn], system=system))
    return out
