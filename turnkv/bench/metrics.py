"""Scores for the quality benchmarks: task metrics (LongBench's normalisation) and fidelity to the
full-cache run of the same model."""

from __future__ import annotations

import re
import string
from collections import Counter

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1_score(prediction: str, reference: str) -> float:
    """Token-level F1 between the normalised prediction and reference."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F-measure, from the rouge-score package."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, prediction)["rougeL"].fmeasure


def greedy_agreement(logprobs: torch.Tensor, reference_tokens: list[int]) -> float:
    """Share of positions where the method's most likely token is the reference run's token, along the
    reference answer (teacher forced). logprobs: [n, V]."""
    return float((logprobs.argmax(-1) == torch.tensor(reference_tokens)).float().mean())


def first_divergence(tokens: list[int], reference_tokens: list[int]) -> int | None:
    """Index of the first generated token that differs from the reference run's, or None."""
    for i, (a, b) in enumerate(zip(tokens, reference_tokens)):
        if a != b:
            return i
    return None if len(tokens) == len(reference_tokens) else min(len(tokens), len(reference_tokens))


def mean_kl(reference_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || method) between next-token distributions. [n, V] each."""
    p = reference_logprobs.double().exp()
    return float((p * (reference_logprobs.double() - logprobs.double())).sum(-1).mean())
