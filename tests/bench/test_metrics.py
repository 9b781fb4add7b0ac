"""Task metrics and fidelity metrics, on cases whose values are known."""

from __future__ import annotations

import math

import pytest
import torch

from turnkv.bench.metrics import (exact_match, f1_score, first_divergence, greedy_agreement, mean_kl,
                                  normalize_answer, rouge_l)


def test_normalisation_follows_longbench():
    assert normalize_answer("The  Eiffel Tower, in Paris!") == "eiffel tower in paris"
    assert exact_match("the Paris.", "Paris") == 1.0 and exact_match("Paris, France", "Paris") == 0.0


def test_f1_counts_overlapping_tokens():
    # prediction 4 tokens, reference 2, overlap 2: precision 0.5, recall 1
    assert f1_score("Paris is in France", "Paris France") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1_score("London", "Paris") == 0.0 and f1_score("", "Paris") == 0.0
    assert f1_score("a the", "Paris") == 0.0  # only articles: nothing left to match


def test_rouge_l_is_the_lcs_f_measure():
    # LCS("the cat sat", "the cat sat down") = 3 words: precision 1, recall 0.75
    assert rouge_l("the cat sat", "the cat sat down") == pytest.approx(2 * 0.75 / 1.75)
    assert rouge_l("dog", "the cat") == 0.0


def test_fidelity_metrics():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    assert mean_kl(ref, ref) == pytest.approx(0.0, abs=1e-12)
    other = torch.log_softmax(torch.zeros(2, 3), -1)
    p = ref.exp()
    expected = float(((p * (ref - math.log(1 / 3))).sum(-1)).mean())
    assert mean_kl(ref, other) == pytest.approx(expected)
    assert greedy_agreement(ref, [0, 1]) == 1.0 and greedy_agreement(ref, [0, 2]) == 0.5
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
