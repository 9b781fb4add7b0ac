"""Reading a benchmark file into records, and the helpers every format's loader shares.

Files are read as JSON lines (one record per line; blank lines skipped), as a JSON array (a file
other than .jsonl whose first character is `[`, or a .jsonl file that is one array), as one
pretty-printed record, or, for `.csv` files (Multi-IF ships as CSV), as CSV with a header.
A bad file raises `DatasetError` (an `InvalidRequestError`) naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import random
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from turnkv.bench.datasets.schema import Turn
from turnkv.errors import InvalidRequestError

__all__ = ["DatasetError", "DatasetFileNotFoundError", "Where", "is_scored", "iter_records", "multiple_choice",
           "parse_answer", "read_records"]

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


class Where:
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


def iter_records(path: str | Path) -> Iterable[tuple[Where, Any]]:
    p = Path(path)
    records = read_records(p)
    if not records:
        raise DatasetError("file holds no records", p)
    for index, (line, record) in enumerate(records):
        yield Where(p, line, index), record


def parse_answer(value: Any, where: Where, name: str) -> str | list[str]:
    """A reference answer: a string, or a non-empty list of strings (numbers are written out)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, list)):
        raise where.error(f"field {name!r} must be a string or a list of strings", name)
    if isinstance(value, list):
        if not value or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            raise where.error(f"field {name!r} must be a non-empty list of strings", name)
        return [str(v) for v in value]
    return str(value)


def is_scored(turn: Turn) -> bool:
    """Whether a runner should score this turn (see the package docstring)."""
    return turn.scored


def multiple_choice(question: str, options: list[str], correct: int,
                     rng: random.Random | None) -> tuple[str, str]:
    """The question with lettered options (shuffled when rng is given), and the correct letter."""
    order = list(range(len(options)))
    if rng is not None:
        rng.shuffle(order)
    letters = string.ascii_uppercase
    lines = [f"{letters[k]}. {options[i]}" for k, i in enumerate(order)]
    text = f"{question}\n\n" + "\n".join(lines) + "\n\nReply with the letter of the right option only."
    return text, letters[order.index(correct)]
