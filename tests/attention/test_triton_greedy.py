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


def stop_cells_for(args, seed):
    """Per-unit stop thresholds: some reached early, some never (inf), one at once (0)."""
    g = torch.Generator().manual_seed(seed)
    l_s, l_v = args[2].cpu(), args[6].cpu()
    N = l_s.shape[0]
    cells = (l_s.sum(1) + l_v.sum(1)).double()
    stop = cells * torch.rand(N, generator=g, dtype=torch.float64) * 0.5
    stop[torch.rand(N, generator=g) < 0.3] = float("inf")
    stop[4] = 0.0
    return stop.to(args[0].device)


@pytest.mark.parametrize("normalised", [True, False])
@pytest.mark.parametrize("max_lines", [None, 6, 10**6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_early_stop_equal_in_every_backend(normalised, max_lines, seed):
    """With stop_cells the three loops agree to the bit; a unit that stops ran the walk without the
    stop up to the first point where its bound reaches stop_cells, and the others did not change."""
    for ties in (True, False):
        args = lists(N=9, seed=seed, ties=ties)
        stop = stop_cells_for(args, seed)
        kw = dict(normalised=normalised, max_lines=max_lines)
        ref = G.greedy(*args, **kw, backend="torch", stop_cells=stop)
        for backend in ("triton", "python"):
            assert_same(G.greedy(*args, **kw, backend=backend, stop_cells=stop), ref)
        full = G.greedy(*args, **kw, backend="torch")
        l_s, l_v = args[2].double(), args[6].double()
        ranks_s, ranks_v = torch.arange(l_s.shape[1], device=l_s.device), torch.arange(l_v.shape[1], device=l_v.device)
        c_s = (l_s * (ranks_s < ref[0][:, None])).sum(1)
        c_v = (l_v * (ranks_v < ref[1][:, None])).sum(1)
        stopped = G.bound(c_s, c_v, ref[0], ref[1]) >= stop
        assert stopped.any() and (~stopped).any()
        assert torch.equal(ref[0][~stopped], full[0][~stopped]) and torch.equal(ref[1][~stopped], full[1][~stopped])
        assert torch.equal(ref[2][~stopped], full[2][~stopped])
        assert (ref[0] <= full[0]).all() and (ref[1] <= full[1]).all()
        # The stopped walk is the walk without the stop cut short where its bound first reaches
        # stop_cells: capped there, the plain walk takes the same lines, and one line less falls short.
        for u in stopped.nonzero().flatten().tolist():
            steps = int(ref[0][u] + ref[1][u])
            if max_lines is not None and steps >= max_lines:
                continue  # the cap stopped it too
            cut = G.greedy(*args, normalised=normalised, backend="torch", max_lines=steps)
            assert int(cut[0][u]) == int(ref[0][u]) and int(cut[1][u]) == int(ref[1][u])
            if steps > int(args[9][u] + args[10][u]):  # not stopped by its forced lines alone
                i, j, _ = G.greedy(*args, normalised=normalised, backend="torch", max_lines=steps - 1)
                c_s, c_v = float(l_s[u, :int(i[u])].sum()), float(l_v[u, :int(j[u])].sum())
                assert max(c_s, c_v, c_s + c_v - int(i[u]) * int(j[u])) < float(stop[u])
        # None and inf everywhere are no stop.
        assert_same(G.greedy(*args, **kw, backend="python", stop_cells=torch.full_like(stop, float("inf"))), full)
