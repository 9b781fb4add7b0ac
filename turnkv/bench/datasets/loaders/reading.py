"""Loaders for the public benchmark files a user may already have: LongBench, LoopServe's multi-turn
LongBench, Multi-IF, PrefEval and SCBench. Each reads one local file and returns `Instance`s.

Files are read as JSON lines (one record per line; blank lines skipped), as a JSON array (a file
other than .jsonl whose first character is `[`, or a .jsonl file that is one array), as one
pretty-printed record, or, for `.csv` files (Multi-IF ships as CSV), as CSV with a header.
A bad file raises `DatasetError` (an `InvalidRequestError`) naming the file, the line and the field.

Conventions the loaders follow, which a quality runner must share:
- A turn whose reference is empty is not scored: it only puts something in the history (PrefEval's
  preference statement, its earlier chat). `is_scored` says which turns count. Multi-IF turns have
  no reference text but are scored by their rule checks (metric "instructions").
- Metric names mean: "f1" token F1 and "rouge_l" Rouge-L against any of the references; "em" exact
  match after normalisation; "contains" the reference appears in the reply; "accuracy" the reply
  picks the reference label (a class name, a count, "Paragraph N", or an option letter A, B, ...).
- Multiple-choice questions carry their options in the question text, lettered A, B, ...; the
  reference is the letter.
- `depends_on` lists only earlier turns, never the turn itself.
"""

from __future__ import annotations

import csv
import json
import random
import re
import string
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.schema import METRICS, POSITIONS, Instance, Turn
from turnkv.errors import InvalidRequestError

__all__ = [
    "DatasetError", "DatasetFileNotFoundError", "FORMATS", "LONGBENCH_METRICS", "SCBENCH_METRICS",
    "is_scored", "load", "load_longbench", "load_loopserve", "load_multi_if", "load_prefeval",
    "load_scbench", "read_records",
]


class DatasetError(InvalidRequestError):
    """A benchmark file is missing, is not valid JSON, or has a record without a field it needs."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None,
                 field: str | None = None):
        self.path, self.line, self.field = (str(path) if path is not None else None), line, field
        where = self.path or ""
        if line is not None:
            where += f", line {line}"
        super().__init__(f"{where}: {message}" if where else message)


class DatasetFileNotFoundError(DatasetError, FileNotFoundError):
    """The benchmark file does not exist."""


# ---------------------------------------------------------------------------------------------
# Reading records


class _Where:
    """A record's place in its file, to build error messages."""

    def __init__(self, path: Path, line: int, index: int):
        self.path, self.line, self.index = path, line, index

    def error(self, message: str, field: str | None = None) -> DatasetError:
        return DatasetError(message, self.path, self.line, field)

    def need(self, record: Any, name: str, types: type | tuple[type, ...] | None = None) -> Any:
        if not isinstance(record, dict):
            raise self.error(f"expected a JSON object, got {type(record).__name__}")
        if name not in record or record[name] is None:
            raise self.error(f"record is missing required field {name!r}", name)
        value = record[name]
        if types is not None and not isinstance(value, types):
            names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            raise self.error(f"field {name!r} must be {names}, got {type(value).__name__}", name)
        return value


def _check_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise DatasetFileNotFoundError(f"no such file: {p}", p)
    if p.is_dir():
        raise DatasetError("is a directory, expected a .jsonl, .json or .csv file", p)
    return p


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _json_array(text: str, path: Path) -> list[tuple[int, Any]]:
    """The elements of a top-level JSON array, each with the line it starts on."""
    decoder, ws = json.JSONDecoder(), " \t\r\n"
    out, i, n = [], text.index("[") + 1, len(text)

    def skip(k: int) -> int:
        while k < n and text[k] in ws:
            k += 1
        return k

    i = skip(i)
    if i < n and text[i] == "]":
        return out
    while True:
        i = skip(i)
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DatasetError(f"invalid JSON: {e.msg} (column {e.colno})", path, e.lineno) from None
        out.append((_line_of(text, i), value))
        i = skip(end)
        if i < n and text[i] == ",":
            i += 1
        elif i < n and text[i] == "]":
            if skip(i + 1) != n:
                raise DatasetError("invalid JSON: extra data after the array", path, _line_of(text, i + 1))
            return out
        else:
            raise DatasetError("invalid JSON: expected ',' or ']' between array elements", path,
                               _line_of(text, min(i, n - 1)) if n else 1)


def read_records(path: str | Path) -> list[tuple[int, Any]]:
    """The records of a JSON-lines, JSON-array or CSV file, each with the line it starts on."""
    p = _check_file(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"not UTF-8 text ({e.reason} at byte {e.start})", p) from None
    if p.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines(keepends=True))
        rows, start = [], 2
        try:
            for row in reader:
                rows.append((start, dict(row)))
                start = reader.line_num + 1
        except csv.Error as e:
            raise DatasetError(f"invalid CSV: {e}", p, reader.line_num) from None
        return rows
    if p.suffix.lower() not in (".jsonl", ".ndjson") and text.lstrip().startswith("["):
        return _json_array(text, p)
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            if not records:  # maybe one pretty-printed record, or an array in a .jsonl file
                try:
                    whole = json.loads(text)
                except json.JSONDecodeError:
                    whole = None
                if isinstance(whole, dict):
                    return [(_line_of(text, len(text) - len(text.lstrip())), whole)]
                if isinstance(whole, list):
                    return _json_array(text, p)
            raise DatasetError(f"invalid JSON: {e.msg} (column {e.colno})", p, number) from None
    return records


def _records(path: str | Path) -> Iterable[tuple[_Where, Any]]:
    p = Path(path)
    records = read_records(p)
    if not records:
        raise DatasetError("file holds no records", p)
    for index, (line, record) in enumerate(records):
        yield _Where(p, line, index), record


def _answer(value: Any, where: _Where, name: str) -> str | list[str]:
    """A reference answer: a string, or a non-empty list of strings (numbers are written out)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, list)):
        raise where.error(f"field {name!r} must be a string or a list of strings", name)
    if isinstance(value, list):
        if not value or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            raise where.error(f"field {name!r} must be a non-empty list of strings", name)
        return [str(v) for v in value]
    return str(value)


def is_scored(turn: Turn) -> bool:
    """Whether a runner should score this turn (see the module docstring)."""
    return turn.scored


def _multiple_choice(question: str, options: list[str], correct: int,
                     rng: random.Random | None) -> tuple[str, str]:
    """The question with lettered options (shuffled when rng is given), and the correct letter."""
    order = list(range(len(options)))
    if rng is not None:
        rng.shuffle(order)
    letters = string.ascii_uppercase
    lines = [f"{letters[k]}. {options[i]}" for k, i in enumerate(order)]
    text = f"{question}\n\n" + "\n".join(lines) + "\n\nReply with the letter of the right option only."
    return text, letters[order.index(correct)]


# ---------------------------------------------------------------------------------------------
# LongBench (THUDM/LongBench jsonl: input, context, answers, length, dataset, language,
# all_classes, _id)

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
_LONGBENCH_KINDS: dict[str, tuple[str, str | None]] = {
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


def _metric_for(name: str, where: _Where, field: str, metrics: dict[str, str] | None) -> tuple[str, str, str]:
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
    for where, rec in _records(path):
        question = where.need(rec, "input", str)
        context = where.need(rec, "context", str)
        answers = _answer(where.need(rec, "answers"), where, "answers")
        name = where.need(rec, "dataset", str)
        dataset, metric, kind = _metric_for(name, where, "dataset", metrics)
        system, default_question = _LONGBENCH_KINDS[kind]
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


# ---------------------------------------------------------------------------------------------
# LoopServe's multi-turn LongBench (turns with begin/middle/end prompts, ground truth and
# dependent_turn_indices; the public file layout is not published, see load_loopserve)


def _depends(value: Any, k: int, where: _Where, field: str) -> list[int]:
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
    for where, rec in _records(path):
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
        dataset, metric, kind = _metric_for(str(name), where, name_field, metrics)
        rid = str(rid) if rid is not None else f"{stem}-{where.line}"

        per_position: dict[str, list[Turn]] = {pos: [] for pos in positions}
        rendered = None
        for k, t in enumerate(turns_data):
            if not isinstance(t, dict):
                raise where.error(f"turn {k} must be a JSON object, got {type(t).__name__}", "turns")
            answer_key = next((a for a in ("ground_truth", "answer", "answers") if t.get(a) is not None), None)
            if answer_key is None:
                raise where.error(f"turn {k} is missing required field 'ground_truth'", "ground_truth")
            answer = _answer(t[answer_key], where, answer_key)
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
        system = None if rendered else _LONGBENCH_KINDS[kind][0]
        for pos in positions:
            out.append(Instance(task=dataset, id=f"{rid}-{pos}", turns=per_position[pos], system=system))
    return out


# ---------------------------------------------------------------------------------------------
# Multi-IF (facebook/Multi-IF: key, language, turn_{k}_prompt, turn_{k}_instruction_id_list,
# turn_{k}_kwargs, k = 1..3; the list fields are JSON text in the published CSV)

_MULTI_IF_TURNS = 3


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        s = value.strip()
        if s[:1] in ("[", "{", '"'):
            try:
                return json.loads(s)
            except json.JSONDecodeError:
                return value
    return value


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "nan", "none", "null"))


def _multi_if_prompt(value: Any, where: _Where, field: str) -> str:
    value = _maybe_json(value)
    if isinstance(value, dict):
        content = value.get("content")
        if not isinstance(content, str):
            raise where.error(f"field {field!r} has no 'content' text", field)
        return content
    if isinstance(value, str):
        return value
    raise where.error(f"field {field!r} must be a message object or text", field)


def _multi_if_instructions(ids: Any, kwargs: Any, where: _Where, k: int) -> list[dict]:
    id_field, kw_field = f"turn_{k}_instruction_id_list", f"turn_{k}_kwargs"
    ids = _maybe_json(ids)
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise where.error(f"field {id_field!r} must be a list of instruction ids", id_field)
    kwargs = [] if _blank(kwargs) and not ids else _maybe_json(kwargs)
    if not isinstance(kwargs, list):
        raise where.error(f"field {kw_field!r} must be a list (one entry per instruction)", kw_field)
    if len(kwargs) != len(ids):
        raise where.error(f"field {kw_field!r} has {len(kwargs)} entries for {len(ids)} instructions", kw_field)
    out = []
    for iid, kw in zip(ids, kwargs):
        kw = {} if _blank(kw) else _maybe_json(kw)
        if not isinstance(kw, dict):
            raise where.error(f"field {kw_field!r}: the arguments of {iid!r} must be an object", kw_field)
        # IFEval's checkers ignore unset (null) arguments; drop them so rule checks see only real ones
        out.append({"kind": iid, **{a: v for a, v in kw.items() if v is not None and a != "kind"}})
    return out


def load_multi_if(path: str | Path, language: str | None = None) -> list[Instance]:
    """Multi-IF: one instance of up to three turns per record (a turn stops the conversation where
    its prompt is empty). Each turn's question is the prompt's `content`, its metric "instructions",
    and its `instructions` the turn's (cumulative) instruction list as {"kind": id, **kwargs}. Every
    turn depends on all earlier turns, whose instructions stay in force. `key` is the id; `language`
    (e.g. "English", the 909-conversation subset FlowKV uses) keeps only that language's records."""
    out = []
    for where, rec in _records(path):
        if not isinstance(rec, dict):
            raise where.error(f"expected a JSON object, got {type(rec).__name__}")
        if language is not None:
            lang = where.need(rec, "language", str)
            if lang.strip().lower() != language.strip().lower():
                continue
        turns: list[Turn] = []
        for k in range(1, _MULTI_IF_TURNS + 1):
            field = f"turn_{k}_prompt"
            if k == 1 and _blank(rec.get(field)):
                raise where.error(f"record is missing required field {field!r}", field)
            if _blank(rec.get(field)):
                later = [f"turn_{j}_prompt" for j in range(k + 1, _MULTI_IF_TURNS + 1)
                         if not _blank(rec.get(f"turn_{j}_prompt"))]
                if later:
                    raise where.error(f"field {field!r} is empty but {later[0]!r} is not", field)
                break
            question = _multi_if_prompt(rec[field], where, field)
            ids = where.need(rec, f"turn_{k}_instruction_id_list")
            if f"turn_{k}_kwargs" not in rec:
                raise where.error(f"record is missing required field 'turn_{k}_kwargs'", f"turn_{k}_kwargs")
            instructions = _multi_if_instructions(ids, rec[f"turn_{k}_kwargs"], where, k)
            turns.append(Turn(context="", question=question, answer="", depends_on=list(range(k - 1)),
                              metric="instructions", instructions=instructions))
        iid = str(rec.get("key") if not _blank(rec.get("key")) else f"{Path(path).stem}-{where.line}")
        out.append(Instance(task="multi_if", id=iid, turns=turns))
    return out


# ---------------------------------------------------------------------------------------------
# PrefEval (amazon-science/PrefEval benchmark_dataset/*/<topic>.json: preference, question,
# explanation; mcq_options adds classification_task_options, whose first entry is the one that
# follows the preference; implicit forms add a `conversation` that reveals the preference)


def _prefeval_history(rec: dict, where: _Where) -> tuple[str, list[Turn]]:
    """The form and the unscored turns that carry the preference."""
    conv = rec.get("conversation")
    if conv is None:
        preference = where.need(rec, "preference", str)
        return "explicit", [Turn(context="", question=preference, answer="")]
    if isinstance(conv, dict) and "user_selection" in conv:
        selection = where.need(conv, "user_selection", str)
        options = conv.get("assistant_options") or ""
        if not isinstance(options, str):
            raise where.error("field 'conversation.assistant_options' must be text", "conversation.assistant_options")
        return "implicit_choice", [Turn(context=options, question=selection, answer="")]
    if isinstance(conv, dict):
        try:
            items = [conv[k] for k in sorted(conv, key=int)]
        except ValueError:
            raise where.error("field 'conversation' must be keyed by turn number or hold 'user_selection'",
                              "conversation") from None
    elif isinstance(conv, list):
        items = conv
    else:
        raise where.error("field 'conversation' must be an object or a list", "conversation")
    turns = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("user"), str):
            raise where.error(f"conversation turn {n} is missing required field 'user'", "conversation.user")
        turns.append(Turn(context="", question=item["user"], answer=""))
    if not turns:
        raise where.error("field 'conversation' is empty", "conversation")
    return "implicit_persona", turns


def load_prefeval(path: str | Path, shuffle: bool = True) -> list[Instance]:
    """PrefEval: per record, the turns that state or reveal the preference (unscored), then the
    question, which depends on them.

    - Explicit form: one turn that states `preference`.
    - Implicit choice form (`conversation` with `user_selection`): one turn whose context is the
      options the assistant offered and whose question is the user's choice.
    - Implicit persona form (`conversation` {"0": {"user", "assistant"}, ...}): one turn per user
      message. The dataset's assistant replies are dropped; the model answers with its own.
    The final question is multiple choice when `classification_task_options` is present: options are
    shuffled (seeded by the instance id, so runs agree) and the reference is the letter of the first
    (preference-following) option, metric "accuracy". Without options the reference is `explanation`
    with metric "rouge_l", only a proxy: PrefEval judges free answers with an LLM. Ids are
    "<topic>-<index in file>", the topic being `topic` or the file name."""
    stem = Path(path).stem
    out = []
    for where, rec in _records(path):
        if not isinstance(rec, dict):
            raise where.error(f"expected a JSON object, got {type(rec).__name__}")
        question = where.need(rec, "question", str)
        form, history = _prefeval_history(rec, where)
        topic = rec.get("topic") if isinstance(rec.get("topic"), str) else stem
        iid = f"{topic}-{where.index}"
        options = rec.get("classification_task_options")
        if options is not None:
            if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
                raise where.error("field 'classification_task_options' must list at least two options",
                                  "classification_task_options")
            rng = random.Random(f"prefeval:{iid}") if shuffle else None
            question, letter = _multiple_choice(question, options, 0, rng)
            final = Turn(context="", question=question, answer=letter, metric="accuracy")
        else:
            explanation = where.need(rec, "explanation", str)
            final = Turn(context="", question=question, answer=explanation, metric="rouge_l")
        final.depends_on = list(range(len(history)))
        out.append(Instance(task=f"prefeval_{form}", id=iid, turns=[*history, final]))
    return out


# ---------------------------------------------------------------------------------------------
# SCBench (microsoft/SCBench scbench_<task>.jsonl: id, context, multi_turns [{input, answer,
# options?, task?}])

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
    for where, rec in _records(path):
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
            answer = _answer(t["answer"], where, "answer")
            if t.get("options") is not None:
                question, answer = _scbench_choice(t, answer, where, k)
                metric = "accuracy"
            turns.append(Turn(context=context if k == 0 else "", question=question, answer=answer,
                              position="end", depends_on=[0] if k else [], metric=metric))
        iid = str(rec["id"]) if rec.get("id") is not None else f"{stem}-{where.line}"
        out.append(Instance(task=f"scbench_{short}", id=iid, turns=turns, system=_SCBENCH_SYSTEM.get(short)))
    return out


def _scbench_choice(t: dict, answer: str | list[str], where: _Where, k: int) -> tuple[str, str]:
    options = t["options"]
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
        raise where.error(f"multi_turns[{k}].options must list at least two options", "options")
    letters = string.ascii_uppercase[: len(options)]
    for a in answer if isinstance(answer, list) else [answer]:
        if a in options:
            return _multiple_choice(t["input"], options, options.index(a), None)
        if a.strip().upper() in letters and len(a.strip()) == 1:
            return _multiple_choice(t["input"], options, letters.index(a.strip().upper()), None)
    raise where.error(f"multi_turns[{k}].answer {answer!r} is neither an option nor an option letter", "answer")


# ---------------------------------------------------------------------------------------------

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
    return FORMATS[key](path, **options)
