"""Scoring one turn's response against its reference, by the turn's metric."""

from __future__ import annotations

import re

from turnkv.bench.datasets.schema import Turn
from turnkv.bench.instruction_checks import check
from turnkv.bench.metrics import exact_match, f1_score, normalize_answer, rouge_l

_OPTION = re.compile(r"\b([A-H])\b")


def score_turn(turn: Turn, response: str) -> float | None:
    """A score in [0, 1]: the best match over the reference answers, or the share of rule checks passed
    (None when no rule of the turn can be checked)."""
    if turn.metric == "instructions":

        results = []
        for rule in turn.instructions:
            try:
                results.append(check(rule, response))
            except ValueError:  # a rule family turnkv has no checker for (some IFEval kinds): not scored
                continue
        return sum(results) / len(results) if results else None
    answers = turn.answer if isinstance(turn.answer, list) else [turn.answer]
    return max(_score_one(turn.metric, response, answer) for answer in answers)


def _score_one(metric: str, response: str, answer: str) -> float:
    if metric == "f1":
        return f1_score(response, answer)
    if metric == "em":
        return exact_match(response, answer)
    if metric == "rouge_l":
        return rouge_l(response, answer)
    if metric == "contains":
        return float(normalize_answer(answer) in normalize_answer(response))
    if metric == "accuracy":  # multiple choice: the first option letter the response names
        match = _OPTION.search(response.strip())
        return float(match is not None and match.group(1) == answer.strip().upper()[:1])
    raise ValueError(f"unknown metric {metric!r}")
