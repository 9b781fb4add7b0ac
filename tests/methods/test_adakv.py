"""Ada-KV's head-wise budget allocation (turnkv.methods.evict.adakv, evict.counts.fit_counts), checked
against the paper's worked example (its Fig. 2), naive re-implementations of the three safeguard
rules, and the L1 eviction-loss bound of Theorem 3.1 on random attention."""

from __future__ import annotations

import math
import random

import pytest
import torch

from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.counts import fit_counts, protected_and_capacity
from turnkv.methods.evict.uniform import UniformAllocator

INF = float("inf")

# The paper's Fig. 2: 3 heads x 6 entries, layer budget B = 6.
PAPER = torch.tensor([
    [0.32, 0.01, 0.18, 0.08, 0.22, 0.19],
    [0.89, 0.01, 0.05, 0.02, 0.01, 0.02],
    [0.68, 0.01, 0.08, 0.04, 0.09, 0.10],
], dtype=torch.float64)


# ---- naive references -------------------------------------------------------------------------

def naive_global_share(scores: torch.Tensor, k: int) -> list[int]:
    """How many of the k largest finite scores of the whole layer fall in each head (plain sorting)."""
    H, S = scores.shape
    entries = [(float(scores[h, j]), h) for h in range(H) for j in range(S) if math.isfinite(float(scores[h, j]))]
    entries.sort(key=lambda e: -e[0])
    share = [0] * H
    for _, h in entries[:k]:
        share[h] += 1
    return share


def hamilton(desired: list[float], total: int) -> list[int]:
    """Largest-remainder rounding: floors, then +1 for the `total - sum(floors)` largest remainders."""
    floors = [math.floor(x) for x in desired]
    left = total - sum(floors)
    order = sorted(range(len(desired)), key=lambda i: -(desired[i] - floors[i]))
    for i in order[:left]:
        floors[i] += 1
    return floors


def per_head_topk_mass(weights: torch.Tensor, counts) -> float:
    """Retained attention mass when head i keeps its own counts[i] largest weights (Theorem 3.2)."""
    return sum(float(weights[h].sort(descending=True).values[: int(c)].sum()) for h, c in enumerate(counts))


def random_scores(gen: torch.Generator, H: int, S: int) -> torch.Tensor:
    """Softmax rows with head-specific temperatures: some heads concentrated, some dispersed."""
    temps = torch.rand(H, 1, generator=gen, dtype=torch.float64) * 4 + 0.2
    return (torch.randn(H, S, generator=gen, dtype=torch.float64) * temps).softmax(dim=-1)


# ---- the paper's worked example ---------------------------------------------------------------

def test_worked_example_pure_adaptive_budgets_and_retained_mass():
    counts = AdaKVAllocator(alpha=0.0, rule="code").allocate(PAPER, 6)
    assert counts.tolist() == [4, 1, 1]
    assert AdaKVAllocator.global_share(PAPER, 6).tolist() == [4, 1, 1]
    uniform = UniformAllocator().allocate(PAPER, 6)
    assert uniform.tolist() == [2, 2, 2]
    adaptive_mass = per_head_topk_mass(PAPER, counts)
    uniform_mass = per_head_topk_mass(PAPER, uniform)
    assert adaptive_mass == pytest.approx(2.48, abs=1e-12)
    assert uniform_mass == pytest.approx(2.26, abs=1e-12)
    # Theorem 3.3: the adaptive per-head top-k keeps exactly the layer's global top-6 mass.
    assert adaptive_mass == pytest.approx(float(PAPER.flatten().topk(6).values.sum()), abs=1e-12)


def test_worked_example_under_each_safeguard_rule():
    # code, alpha=0.2: 0.8*(4,1,1) + 0.2*2 = (3.6, 1.2, 1.2) -> largest remainder (4, 1, 1)
    assert AdaKVAllocator().allocate(PAPER, 6).tolist() == [4, 1, 1]
    # paper, alpha=0.2: 0.2*(4,1,1) + 0.8*2 = (2.4, 1.8, 1.8) -> (2, 2, 2)
    assert AdaKVAllocator(rule="paper").allocate(PAPER, 6).tolist() == [2, 2, 2]
    # code, alpha=0.5: 0.5*(4,1,1) + 0.5*2 = (3, 1.5, 1.5) -> floors (3,1,1); the one slot left goes to
    # one of the two tied remainders
    half = AdaKVAllocator(alpha=0.5).allocate(PAPER, 6)
    assert half.sum() == 6 and half[0] == 3 and sorted(half[1:].tolist()) == [1, 2]
    # kvpress, alpha=0.5: every head forces its top floor(0.5*2)=1 (0.32, 0.89, 0.68); the global top-3
    # of the rest is (0.22, 0.19, 0.18), all in head 0 -> (4, 1, 1)
    assert AdaKVAllocator(rule="kvpress", alpha=0.5).allocate(PAPER, 6).tolist() == [4, 1, 1]
    # alpha = 1 in the code rule is uniform allocation
    assert AdaKVAllocator(alpha=1.0).allocate(PAPER, 6).tolist() == [2, 2, 2]
    # B = 9: global top-9 adds 0.10, 0.09, 0.08 (0.08 ties between heads 0 and 2) -> share is (5,1,3) or (4,1,4)
    assert AdaKVAllocator.global_share(PAPER, 9).tolist() in ([5, 1, 3], [4, 1, 4])


def test_invalid_parameters_are_rejected():
    with pytest.raises(ValueError):
        AdaKVAllocator(alpha=1.5)
    with pytest.raises(ValueError):
        AdaKVAllocator(alpha=-0.1)
    with pytest.raises(ValueError):
        AdaKVAllocator(rule="fancy")


# ---- the safeguard rules on random layers -------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_code_rule_is_largest_remainder_of_mixed_share(alpha):
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    for _ in range(40):
        H, S = rng.randint(2, 8), rng.randint(4, 24)
        scores = random_scores(gen, H, S)
        total = rng.randint(1, H * S - 1)
        counts = AdaKVAllocator(alpha=alpha).allocate(scores, total)
        f = naive_global_share(scores, total)
        assert AdaKVAllocator.global_share(scores, total).tolist() == f
        assert sum(f) == total
        b = total / H
        desired = [(1 - alpha) * fi + alpha * b for fi in f]
        assert counts.tolist() == hamilton(desired, total)
        assert int(counts.sum()) == total
        assert all(abs(c - d) < 1 for c, d in zip(counts.tolist(), desired))


def test_paper_rule_is_largest_remainder_of_mostly_uniform_share():
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    for _ in range(40):
        H, S = rng.randint(2, 8), rng.randint(4, 24)
        scores = random_scores(gen, H, S)
        total = rng.randint(1, H * S - 1)
        counts = AdaKVAllocator(alpha=0.2, rule="paper").allocate(scores, total)
        f = naive_global_share(scores, total)
        desired = [0.2 * fi + 0.8 * total / H for fi in f]
        assert counts.tolist() == hamilton(desired, total)
        assert int(counts.sum()) == total


@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_kvpress_rule_forces_each_heads_own_top_then_one_global_topk(alpha):
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    for _ in range(40):
        H, S = rng.randint(2, 8), rng.randint(4, 24)
        scores = random_scores(gen, H, S)
        total = rng.randint(H, H * S - 1)
        counts = AdaKVAllocator(alpha=alpha, rule="kvpress").allocate(scores, total)
        forced = min(int(alpha * total / H), S)
        # Naive: take each head's top `forced`, then the global top of what is left.
        rest = scores.clone()
        for h in range(H):
            rest[h, rest[h].argsort(descending=True)[:forced]] = -INF
        share = naive_global_share(rest, total - H * forced)
        assert counts.tolist() == [forced + s for s in share]
        assert int(counts.sum()) == total
        assert int(counts.min()) >= math.floor(alpha * total / H)


def test_protected_entries_are_counted_per_head_and_do_not_compete():
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    for _ in range(30):
        H, S = rng.randint(2, 6), rng.randint(10, 24)
        base = random_scores(gen, H, S)
        scores = base.clone()
        for h in range(H):
            idx = torch.randperm(S, generator=gen)
            n_prot, n_out = rng.randint(0, 3), rng.randint(0, 3)
            scores[h, idx[:n_prot]] = INF
            scores[h, idx[n_prot : n_prot + n_out]] = -INF
        protected, free = protected_and_capacity(scores)
        assert protected.tolist() == [int(torch.isposinf(scores[h]).sum()) for h in range(H)]
        total = int(protected.sum()) + rng.randint(1, int(free.sum()) // 2)
        budget = total - int(protected.sum())
        for alpha in (0.0, 0.2):
            counts = AdaKVAllocator(alpha=alpha).allocate(scores, total)
            assert int(counts.sum()) == total
            assert (counts >= protected).all() and (counts <= protected + free).all()
            # The competition sees only the finite scores: +inf entries are not part of the global top-k.
            competing = torch.where(torch.isfinite(scores), scores, torch.tensor(-INF, dtype=scores.dtype))
            f = naive_global_share(competing, budget)
            desired = [(1 - alpha) * fi + alpha * budget / H for fi in f]
            if all(math.ceil(d) <= int(c) for d, c in zip(desired, free)):  # no capacity limit binds
                assert (counts - protected).tolist() == hamilton(desired, budget)


def test_protected_entries_change_the_result_exactly_as_removed_entries_would():
    # Head 0 has two +inf entries (e.g. its observation window); they are kept on top of its share.
    scores = PAPER.clone()
    scores[0, 1] = INF
    scores[0, 3] = INF
    counts = AdaKVAllocator(alpha=0.0).allocate(scores, 8)
    # the 6 free slots go to the global top-6 of the finite scores: 0.89 0.68 0.32 0.22 0.19 0.18 -> (4,1,1)
    assert counts.tolist() == [2 + 4, 1, 1]


def test_non_candidates_never_receive_budget():
    scores = torch.full((3, 10), -INF, dtype=torch.float64)
    scores[0, :2] = torch.tensor([0.9, 0.8])  # head 0: only two candidates, the layer's best scores
    scores[1, :] = torch.linspace(0.5, 0.05, 10)
    scores[2, :7] = torch.linspace(0.45, 0.01, 7)
    for alloc in (AdaKVAllocator(alpha=0.0), AdaKVAllocator(), AdaKVAllocator(rule="paper"),
                  AdaKVAllocator(rule="kvpress"), UniformAllocator()):
        for total in (3, 9, 15, 19):
            counts = alloc.allocate(scores, total)
            assert int(counts.sum()) == total, (alloc, total)
            assert counts.tolist()[0] <= 2 and counts.tolist()[2] <= 7, (alloc, total)
    # asking for more than there are candidates gives every candidate, and nothing else
    assert AdaKVAllocator().allocate(scores, 30).tolist() == [2, 10, 7]
    assert UniformAllocator().allocate(scores, 30).tolist() == [2, 10, 7]


def test_capacity_clamping_redistributes_to_heads_with_room():
    scores = torch.full((3, 8), -INF, dtype=torch.float64)
    scores[0, :2] = torch.tensor([0.9, 0.8])
    scores[1] = torch.tensor([0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    scores[2] = torch.tensor([0.65, 0.55, 0.45, 0.35, 0.25, 0.15, 0.08, 0.01])
    # Uniform wants 4 each; head 0 holds 2, its 2 extra go one each to heads 1 and 2.
    assert UniformAllocator().allocate(scores, 12).tolist() == [2, 5, 5]
    assert AdaKVAllocator(alpha=1.0).allocate(scores, 12).tolist() == [2, 5, 5]
    # 13: the 3 extra tokens spread as evenly as possible
    c = UniformAllocator().allocate(scores, 13).tolist()
    assert c[0] == 2 and sorted(c[1:]) == [5, 6]
    # Pure adaptive, B=12: global top-12 = head0 {0.9,0.8}, head1 five, head2 five.
    assert AdaKVAllocator(alpha=0.0).allocate(scores, 12).tolist() == [2, 5, 5]
    # code rule alpha=0.5 at B=6: f = (2, 2, 2)? global top-6 = 0.9 0.8 0.7 0.65 0.6 0.55 -> (2, 2, 2)
    assert AdaKVAllocator(alpha=0.5).allocate(scores, 6).tolist() == [2, 2, 2]
    # alpha=0.5, B=15: f = (2, 7, 6) [0.9 0.8 | 0.7 .6 .5 .4 .3 .2 .1 | .65 .55 .45 .35 .25 .15]
    # desired 0.5*f + 2.5 = (3.5, 6, 5.5); head 0 is clamped to 2, the 1.5 it cannot hold goes to the others
    c = AdaKVAllocator(alpha=0.5).allocate(scores, 15).tolist()
    assert c[0] == 2 and sum(c) == 15 and c[1] >= 6 and c[2] >= 5 and c[1] <= 8 and c[2] <= 8


def test_fit_counts_unit_cases():
    cap = torch.tensor([10, 10, 10])
    assert fit_counts(torch.tensor([3.6, 1.2, 1.2]), cap, 6).tolist() == [4, 1, 1]
    assert fit_counts(torch.tensor([2.4, 1.8, 1.8]), cap, 6).tolist() == [2, 2, 2]
    # total above what the heads can hold: every head full
    assert fit_counts(torch.tensor([5.0, 5.0, 5.0]), torch.tensor([1, 2, 3]), 12).tolist() == [1, 2, 3]
    # floors over the capacity: clamped, then the shortfall goes where there is room
    assert fit_counts(torch.tensor([7.0, 1.0, 0.0]), torch.tensor([3, 10, 10]), 8).tolist() in ([3, 3, 2], [3, 2, 3])
    # negative desires count as zero
    assert fit_counts(torch.tensor([-2.0, 3.0, 1.0]), cap, 4).tolist() == [0, 3, 1]
    rng = random.Random(5)
    for _ in range(200):
        H = rng.randint(1, 7)
        capacity = torch.tensor([rng.randint(0, 12) for _ in range(H)])
        desired = torch.tensor([rng.uniform(0, 12) for _ in range(H)], dtype=torch.float64)
        total = rng.randint(0, 60)
        counts = fit_counts(desired, capacity, total)
        assert int(counts.sum()) == min(total, int(capacity.sum()))
        assert (counts >= 0).all() and (counts <= capacity).all()


# ---- Theorem 3.1 / 3.2 / 3.3 on random attention -------------------------------------------------

def l1_loss_and_bound(A: torch.Tensor, M: torch.Tensor, counts) -> tuple[float, float, float]:
    """One query per head. A [h, n] softmax weights, M [h, n, d] = V_i W_i^O. Per-head top-counts[i]
    eviction. Returns (||y - y_hat||_1, the Theorem 3.1 bound, the retained mass)."""
    h, _n = A.shape
    I = torch.zeros_like(A)
    for i, c in enumerate(counts):
        I[i, A[i].argsort(descending=True)[: int(c)]] = 1.0
    y = torch.einsum("hn,hnd->d", A, M)
    kept = A * I
    # = softmax with the evicted logits at -inf; a head that keeps nothing (alpha=0 can starve a head)
    # contributes nothing, and the bound still holds for it (F_i = 0: ||A_i M_i||_1 <= C <= 2C).
    A_hat = kept / kept.sum(dim=1, keepdim=True).clamp(min=1e-300)
    y_hat = torch.einsum("hn,hnd->d", A_hat, M)
    C = float(M.abs().sum(dim=-1).max())  # max_i ||V_i W_i^O||_inf (max row L1 norm)
    retained = float((I * A).sum())
    return float((y - y_hat).abs().sum()), 2 * h * C - 2 * C * retained, retained


def test_l1_eviction_loss_bound_and_adaptive_optimality():
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    wins = 0
    for trial in range(60):
        h, n, dh, d = rng.randint(2, 8), rng.randint(8, 40), 8, 16
        q = torch.randn(h, dh, generator=gen, dtype=torch.float64)
        K = torch.randn(h, n, dh, generator=gen, dtype=torch.float64)
        K = K * (torch.rand(h, 1, 1, generator=gen, dtype=torch.float64) * 3)  # concentrated vs dispersed heads
        A = torch.einsum("hd,hnd->hn", q, K).softmax(dim=-1)
        V = torch.randn(h, n, dh, generator=gen, dtype=torch.float64)
        WO = torch.randn(h, dh, d, generator=gen, dtype=torch.float64)
        M = V @ WO
        B = rng.randint(h, h * n - 1)
        ada = AdaKVAllocator(alpha=0.0).allocate(A, B)
        uni = UniformAllocator().allocate(A, B)
        assert int(ada.sum()) == B and int(uni.sum()) == B
        loss_a, bound_a, kept_a = l1_loss_and_bound(A, M, ada.tolist())
        loss_u, bound_u, kept_u = l1_loss_and_bound(A, M, uni.tolist())
        assert loss_a <= bound_a + 1e-9
        assert loss_u <= bound_u + 1e-9
        assert bound_a <= bound_u + 1e-9 and kept_a >= kept_u - 1e-12
        # Theorem 3.3: adaptive budgets + per-head top-k retain the layer's global top-B mass.
        assert kept_a == pytest.approx(float(A.flatten().topk(B).values.sum()), abs=1e-12)
        # ... which no other allocation of B beats (random compositions of B).
        for _ in range(5):
            cuts = sorted(rng.sample(range(1, B + h), h - 1))
            parts = [b - a - 1 for a, b in zip([0, *cuts], [*cuts, B + h])]
            if all(p <= n for p in parts):
                assert per_head_topk_mass(A, parts) <= kept_a + 1e-12
        # Theorem 3.2: for fixed budgets, per-head top-k beats a random subset of the same sizes.
        rand_kept = sum(float(A[i, torch.randperm(n, generator=gen)[: int(c)]].sum()) for i, c in enumerate(ada))
        assert rand_kept <= kept_a + 1e-12
        wins += bound_a < bound_u - 1e-12
    assert wins >= 50  # the adaptive bound is usually strictly lower on heads of differing concentration


def test_masked_softmax_is_renormalised_kept_weights():
    # Masking logits to -inf then softmax equals renormalising the kept weights.
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    A = logits.softmax(dim=-1)
    counts = AdaKVAllocator(alpha=0.0).allocate(A, 15)
    for i, c in enumerate(counts.tolist()):
        keep = A[i].argsort(descending=True)[:c]
        masked = torch.full_like(logits[i], -INF)
        masked[keep] = logits[i, keep]
        renorm = torch.zeros_like(A[i])
        renorm[keep] = A[i, keep] / A[i, keep].sum()
        torch.testing.assert_close(masked.softmax(dim=-1), renorm, rtol=1e-12, atol=1e-14)
