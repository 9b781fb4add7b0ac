"""Multi-IF (facebook/Multi-IF: key, language, turn_{k}_prompt, turn_{k}_instruction_id_list,
turn_{k}_kwargs, k = 1..3; the list fields are JSON text in the published CSV)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.loaders.reading import Where, iter_records
from turnkv.bench.datasets.schema import Instance, Turn


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


def _multi_if_prompt(value: Any, where: Where, field: str) -> str:
    value = _maybe_json(value)
    if isinstance(value, dict):
        content = value.get("content")
        if not isinstance(content, str):
            raise where.error(f"field {field!r} has no 'content' text", field)
        return content
    if isinstance(value, str):
        return value
    raise where.error(f"field {field!r} must be a message object or text", field)


def _multi_if_instructions(ids: Any, kwargs: Any, where: Where, k: int) -> list[dict]:
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
    for where, rec in iter_records(path):
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
