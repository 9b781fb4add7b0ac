"""LoopServe's selection kernels against their references: the greedy (Algorithm 5's loop) as a
Triton kernel and as the CPU's scalar Python loop, each equal to the torch loop to the bit, and the
diagonal sums read in place against the scatter. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import lines  # noqa: E402
from turnkv.methods.loopserve import greedy as G  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def lists(N=7, Ms=45, Mv=38, seed=0, ties=True, padding=True):
    """Sorted slash/vertical lists like select() builds, with exact ties (values on a 1/4 grid, equal
    lengths), padding (n_s, n_v below the widths), forced lines and a unit that stops at once."""
    g = torch.Generator().manual_seed(seed)

    def desc(M):
        x = torch.rand(N, M, generator=g)
        x = (x * 4).round() / 4 if ties else x.pow(3)
        return x.sort(dim=1, descending=True).values

    w_s, w_v = desc(Ms), desc(Mv)
    s_max = w_s * torch.rand(N, Ms, generator=g)
    v_max = w_v * torch.rand(N, Mv, generator=g)
    l_s = torch.randint(1, 12 if ties else 200, (N, Ms), generator=g).float()
    l_v = torch.randint(1, 12 if ties else 200, (N, Mv), generator=g).float()
    n_s = torch.randint(0, Ms + 1, (N,), generator=g) if padding else torch.full((N,), Ms)
    n_v = torch.randint(0, Mv + 1, (N,), generator=g) if padding else torch.full((N,), Mv)
    n_s[0], n_v[0] = Ms, 0  # only slash lines
    n_s[1], n_v[1] = 0, Mv  # only vertical lines
    forced_s = torch.minimum(torch.randint(0, 3, (N,), generator=g), n_s)
    forced_v = torch.minimum(torch.randint(0, 3, (N,), generator=g), n_v)
    target = torch.rand(N, generator=g) * 0.6 * (w_s.sum(1) + w_v.sum(1))
    target[2] = 0.0  # reached before the first step
    target[3] = 1e9  # never reached: takes every line
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return tuple(map(to, (w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, forced_s, forced_v)))


def assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # the counts
    assert a[0].dtype == b[0].dtype and a[2].dtype == b[2].dtype
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)  # the same fp32 operations in the same order


@pytest.mark.parametrize("normalised", [True, False])
@pytest.mark.parametrize("max_lines", [None, 1, 6, 40, 10**6])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_backends_equal_the_torch_loop(normalised, max_lines, seed):
    for ties in (True, False):
        args = lists(seed=seed, ties=ties)
        ref = G.greedy(*args, normalised=normalised, max_lines=max_lines, backend="torch")
        for backend in ("triton", "python"):
            assert_same(G.greedy(*args, normalised=normalised, max_lines=max_lines, backend=backend), ref)


def test_greedy_kernel_on_long_lists_with_a_host_bound_on_forced_lines():
    args = lists(N=5, Ms=300, Mv=200, seed=3, ties=True, padding=False)
    ref = G.greedy(*args, backend="torch")
    for backend in ("triton", "python"):
        assert_same(G.greedy(*args, backend=backend, max_forced=2), ref)  # forced counts are < 3
    assert (ref[0] + ref[1]).max() > 100


def test_greedy_units_that_stop_at_once_and_empty_batches():
    args = list(lists(N=4, seed=5))
    args[8] = torch.zeros(4, device=DEVICE)  # every target reached by the forced lines
    for backend in ("torch", "triton", "python"):
        i, j, _ = G.greedy(*args, backend=backend)
        assert torch.equal(i, args[9]) and torch.equal(j, args[10])
    empty = [x[:0] for x in lists()]
    for backend in ("torch", "triton", "python"):
        i, j, total = G.greedy(*empty, backend=backend)
        assert i.shape == j.shape == total.shape == (0,)


def test_greedy_backend_choice():
    assert G.resolve(torch.device("cpu")) == "python"
    assert G.resolve(torch.device("cuda")) == "triton"
    assert G.resolve(torch.device("cpu"), "triton") == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        G.resolve(torch.device("cpu"), "numba")


@pytest.mark.parametrize("B,R,S,O", [(1, 5, 300, 300), (2, 7, 200, 260), (3, 4, 50, 900), (1, 3, 1500, 1100)])
def test_diagonal_sums_equal_the_scatter(B, R, S, O):
    """Entries at their positions: the diagonals read in place (torch loop and kernel) equal the
    scatter over offsets: sums bitwise (rows added in the same order), maxima exactly."""
    g = torch.Generator().manual_seed(B * 100 + R)
    U = 3
    weights = torch.rand(B * U, R, S, generator=g)
    positions = [sorted(torch.randint(0, O, (R,), generator=g).tolist()) for _ in range(B)]
    pos = torch.tensor(positions)
    offsets = (pos[:, :, None] - torch.arange(S)).clamp_min(0).repeat_interleave(U, dim=0)
    # Cells past their row (negative offsets) and diagonals past num_offsets hold no weight.
    visible = ((pos[:, :, None] >= torch.arange(S)) & (pos[:, :, None] - torch.arange(S) < O))
    weights = weights * visible.repeat_interleave(U, dim=0)
    ref = lines.line_sums(weights, offsets, O)
    loop = lines.line_sums(weights, None, O, positions)
    assert all(torch.equal(a, b) for a, b in zip(loop, ref))
    w_s, s_max = lines.diagonal_sums(weights.to(DEVICE), positions, O, force_triton=True)
    assert torch.equal(w_s.cpu(), ref[2]) and torch.equal(s_max.cpu(), ref[3])
