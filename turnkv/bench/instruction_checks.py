"""Rule checks for formatting instructions, in the manner of IFEval's checkers (which Multi-IF uses).

check(instruction, response) -> bool. An instruction is a dict with a "kind" (a key of CHECKS:
lowercase, uppercase, min/max_words, min/max_sentences, include, exclude, end, start, quotes,
no_commas, postscript, bullets, json, title) and its parameters, or one of IFEval's instruction ids
for these families with IFEval's arguments (IFEVAL maps them; other families raise ValueError).
A blank response fails every check. The rules, kind by kind: docs/benchmarks.md#instruction-checks"""

from __future__ import annotations

import json
import re

_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def count_sentences(text: str) -> int:
    return sum(1 for part in _SENTENCE_END.split(text.strip()) if _WORD.search(part))


def _strip_fence(text: str) -> str:
    text = text.strip()
    for prefix in ("```json", "```JSON", "```Json", "```"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return text.removesuffix("```").strip()


def _json(response: str) -> bool:
    try:
        json.loads(_strip_fence(response))
    except ValueError:
        return False
    return True


def _contains_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE) is not None


def _postscript(response: str, marker: str) -> bool:
    spaced = r"\.\s?".join(re.escape(part) for part in marker.lower().rstrip(".").split("."))  # p.s. or p. s.
    return re.search(rf"(^|\s){spaced}\.?(\s|$)", response.lower()) is not None


def _bullets(response: str) -> int:
    return len(re.findall(r"^\s*\*[^*].*$", response, flags=re.MULTILINE)) + \
        len(re.findall(r"^\s*-\s.*$", response, flags=re.MULTILINE))


def _unquoted(response: str) -> str:
    return response.strip().strip('"').strip().lower()


CHECKS = {
    "lowercase": lambda r, i: r == r.lower(),
    "uppercase": lambda r, i: r == r.upper(),
    "min_words": lambda r, i: count_words(r) >= i["n"],
    "max_words": lambda r, i: count_words(r) <= i["n"],
    "min_sentences": lambda r, i: count_sentences(r) >= i["n"],
    "max_sentences": lambda r, i: count_sentences(r) <= i["n"],
    "include": lambda r, i: all(w.lower() in r.lower() for w in i["words"]),
    "exclude": lambda r, i: not any(_contains_word(r, w) for w in i.get("words", [i.get("word")]) if w),
    "end": lambda r, i: _unquoted(r).endswith(i["phrase"].strip().lower()),
    "start": lambda r, i: _unquoted(r).startswith(i["phrase"].strip().lower()),
    "quotes": lambda r, i: len(r.strip()) > 1 and r.strip()[0] == '"' and r.strip()[-1] == '"',
    "no_commas": lambda r, i: "," not in r,
    "postscript": lambda r, i: _postscript(r, i.get("marker", "P.S.")),
    "bullets": lambda r, i: _bullets(r) == i["n"],
    "json": lambda r, i: _json(r),
    "title": lambda r, i: any(t.strip("<>").strip() for t in re.findall(r"<<[^\n]+>>", r)),
}


def _relation(unit: str, relation: str, n: int) -> dict:
    if relation == "less than":
        return {"kind": f"max_{unit}", "n": n - 1}
    if relation == "at least":
        return {"kind": f"min_{unit}", "n": n}
    raise ValueError(f"unknown relation {relation!r}")


IFEVAL = {  # IFEval instruction id -> the same rule in this module's terms, from IFEval's arguments
    "change_case:english_lowercase": lambda a: {"kind": "lowercase"},
    "change_case:english_capital": lambda a: {"kind": "uppercase"},
    "length_constraints:number_words": lambda a: _relation("words", a["relation"], a["num_words"]),
    "length_constraints:number_sentences": lambda a: _relation("sentences", a["relation"], a["num_sentences"]),
    "keywords:existence": lambda a: {"kind": "include", "words": a["keywords"]},
    "keywords:forbidden_words": lambda a: {"kind": "exclude", "words": a["forbidden_words"]},
    "startend:end_checker": lambda a: {"kind": "end", "phrase": a["end_phrase"]},
    "startend:quotation": lambda a: {"kind": "quotes"},
    "punctuation:no_comma": lambda a: {"kind": "no_commas"},
    "detectable_content:postscript": lambda a: {"kind": "postscript", "marker": a.get("postscript_marker") or "P.S."},
    "detectable_format:number_bullet_lists": lambda a: {"kind": "bullets", "n": a["num_bullets"]},
    "detectable_format:json_format": lambda a: {"kind": "json"},
    "detectable_format:title": lambda a: {"kind": "title"},
}


def check(instruction: dict, response: str) -> bool:
    """Whether `response` follows `instruction` (a dict with a "kind" in CHECKS or IFEVAL and its
    parameters)."""
    kind = instruction.get("kind")
    if kind in IFEVAL:
        try:
            instruction = IFEVAL[kind](instruction)
        except KeyError as e:
            raise ValueError(f"instruction {kind!r} lacks its argument {e}") from None
        kind = instruction["kind"]
    if kind not in CHECKS:
        raise ValueError(f"unknown instruction kind {kind!r}; known: {sorted(CHECKS)} and IFEval's {sorted(IFEVAL)}")
    if not response or not response.strip():
        return False
    return bool(CHECKS[kind](response, instruction))
