"""The greedy of LoopServe's Algorithm 5, batched over selection units.

Each unit (a head) holds its slash and vertical lines sorted by descending sum. The greedy always takes
the head of one list, so after it stops the selected lines are the first `i` slash and the first `j`
vertical lines of the sorted orders: its result is two counts per unit.

Three implementations of the same loop, equal to the bit (same fp32 operations in the same order):
- the Triton kernel (turnkv/attention/triton/greedy.py), one program per unit running the sequential
  loop on scalars: one launch, no host read. It runs on CUDA.
- the torch loop (greedy_torch), the reference, and the CUDA path without Triton: every quantity the
  comparison needs at (i, j) is an entry of the sorted arrays, so one iteration advances every unit by
  one line with a few gathers, with no per-unit Python loop (but one iteration of ~20 small ops per
  line, and a host read every CHECK_EVERY iterations to stop).
- the scalar Python loop per unit (greedy_python), the CPU path: on a CPU a torch op costs microseconds
  whatever its size, so the unit-by-unit loop on Python floats (fp32 results emulated by rounding each
  operation, exact: see there) is faster than the torch loop, which also runs until the slowest unit
  is done.

The early stop (stop_cells, optional): l_s and l_v are each line's cells, slash lines are disjoint
among themselves, vertical lines too, and a slash and a vertical line share at most one cell. So the
cells of the lines taken so far (the first i slash and j vertical lines, forced ones included) are
at least bound = max(c_s, c_v, c_s + c_v - i*j), c_s and c_v the sums of their lengths, and any
later selection, a superset, covers at least as many. A unit stops once bound >= stop_cells: the
caller sets stop_cells where that many cells settle its decision (LoopServePrefill: the unit attends
densely). The sums are fp64, exact for integer lengths below 2**53 in all three implementations.
"""

from __future__ import annotations

import array
import functools

import torch

from turnkv.attention.triton import available

CHECK_EVERY = 32  # iterations between the host reads that stop the torch loop once every unit is done
BACKENDS = ("auto", "triton", "torch", "python")


def prefix(x: torch.Tensor) -> torch.Tensor:
    """[N, M] -> [N, M + 1] running sums with a leading zero: prefix(x)[:, k] = sum of the first k."""
    return torch.nn.functional.pad(x.cumsum(dim=1), (1, 0))


def bound(c_s, c_v, i, j):
    """The early stop's lower bound of the cells of i slash and j vertical lines whose lengths sum to
    c_s and c_v (fp64 [N]): max(c_s, c_v, c_s + c_v - i*j), in the operations the loops use."""
    return torch.maximum(torch.maximum(c_s, c_v), c_s + c_v - i.double() * j.double())


def start_cells(l_s, l_v, i, j, max_forced: int | None = None):
    """(c_s, c_v) fp64 [N]: the summed lengths of the forced lines, the first i slash and j vertical
    lines of the sorted orders (max_forced: as in start())."""
    N = l_s.shape[0]
    ar = torch.arange(N, device=l_s.device)
    ks = l_s.shape[1] if max_forced is None else min(l_s.shape[1], max_forced)
    kv = l_v.shape[1] if max_forced is None else min(l_v.shape[1], max_forced)
    return prefix(l_s[:, :ks].double())[ar, i], prefix(l_v[:, :kv].double())[ar, j]


def start(w_s, s_max, w_v, v_max, forced_s, forced_v, max_forced: int | None = None):
    """The state once the forced lines are taken: i, j, total, ol_s, ol_v [N].

    Forced lines are counted as if all slash lines came first, then the vertical ones. max_forced, a
    bound on forced_s and forced_v known on the host, limits the running sums to the columns they
    need (on a GPU, scans of whole [N, 128K] rows cost more than the greedy itself)."""
    N = w_s.shape[0]
    ar = torch.arange(N, device=w_s.device)
    ks = w_s.shape[1] if max_forced is None else min(w_s.shape[1], max_forced)
    kv = w_v.shape[1] if max_forced is None else min(w_v.shape[1], max_forced)
    i, j = forced_s.clone(), forced_v.clone()
    ol_s, ol_v = prefix(s_max[:, :ks])[ar, i], prefix(v_max[:, :kv])[ar, j]
    total = prefix(w_s[:, :ks])[ar, i] + prefix(w_v[:, :kv])[ar, j] - j * ol_s
    return i, j, total, ol_s, ol_v


@functools.cache
def _kernel():
    if not available():
        return None
    from turnkv.attention.triton import greedy as kernel

    return kernel


def resolve(device: torch.device, backend: str = "auto") -> str:
    """The loop that runs: "auto" is the kernel on CUDA (the torch loop if Triton is missing) and the
    Python loop elsewhere; "triton" runs the kernel anywhere Triton imports (its interpreter on CPU, for
    tests)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "auto":
        backend = ("triton" if _kernel() is not None else "torch") if device.type == "cuda" else "python"
    if backend == "triton" and _kernel() is None:
        raise RuntimeError("the triton greedy needs triton")
    return backend


def greedy(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, forced_s, forced_v,
           normalised: bool = True, max_lines: int | None = None, backend: str = "auto",
           max_forced: int | None = None, stop_cells: torch.Tensor | None = None):
    """Counts (i, j) of slash and vertical lines taken, and the estimated mass they cover.

    w_s, s_max, l_s [N, Ms]: slash sums, largest entries and lengths in descending order of w_s (forced
    lines first); w_v, v_max, l_v [N, Mv] likewise for vertical lines. n_s, n_v [N]: lines available
    (padding after them). target [N]: alpha times the sampled mass. forced_s, forced_v [N]: the forced
    lines at the front, taken before the greedy starts. The estimate subtracts w^max of the other kind
    of line already taken (ol_s, ol_v): a slash and a vertical line share at most one cell, so it never
    exceeds the mass really covered. backend: one of BACKENDS (see resolve()); all give
    the same result. max_forced: a host bound on forced_s and forced_v, or None (see start()).
    stop_cells [N] or None: the early stop (module docstring); a unit stops once its bound of the
    taken lines' cells reaches stop_cells (inf: never), its (i, j, total) then those of the
    truncated walk. None: no stop."""
    Ms, Mv = w_s.shape[1], w_v.shape[1]
    # Every unit takes at most its n_s + n_v lines, so the cap never needs to exceed Ms + Mv.
    cap = min(max_lines, Ms + Mv) if max_lines is not None else Ms + Mv
    n_s, n_v = n_s.clamp_max(Ms), n_v.clamp_max(Mv)
    state = start(w_s, s_max, w_v, v_max, forced_s, forced_v, max_forced)
    stop = None
    if stop_cells is not None:
        stop = (*start_cells(l_s, l_v, state[0], state[1], max_forced), stop_cells.to(torch.float64))
    backend = resolve(w_s.device, backend)
    args = (w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, *state, cap, normalised)
    if backend == "triton" and Ms and Mv:
        return _kernel().greedy(*args, stop=stop)
    if backend == "python":
        return greedy_python(*args, stop=stop)
    return greedy_torch(*args, stop=stop)


def greedy_torch(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, i, j, total, ol_s, ol_v, cap: int,
                 normalised: bool = True, stop=None):
    """The loop of greedy() in torch, every unit one line per iteration, from the state start() gives;
    stop: None or (c_s, c_v, stop_cells) fp64 [N], the early stop's state (start_cells())."""
    N = w_s.shape[0]
    ar = torch.arange(N, device=w_s.device)
    cap = torch.full_like(i, cap)
    zero = torch.zeros_like(total)
    if stop is not None:
        c_s, c_v, stop_cells = stop
        zero64 = torch.zeros_like(c_s)
    for it in range(w_s.shape[1] + w_v.shape[1]):
        can_s, can_v = i < n_s, j < n_v
        active = (total < target) & (can_s | can_v) & (i + j < cap)
        if stop is not None:
            active &= bound(c_s, c_v, i, j) < stop_cells
        if it % CHECK_EVERY == 0 and not bool(active.any()):
            break
        si, vj = i.clamp_max(w_s.shape[1] - 1), j.clamp_max(w_v.shape[1] - 1)
        gain_s = w_s[ar, si] - ol_v  # Alg. 5 line 11
        gain_v = w_v[ar, vj] - ol_s
        if normalised:  # line 12, cross-multiplied: both denominators are >= 1
            den_s = (l_s[ar, si] - j).clamp_min(1)
            den_v = (l_v[ar, vj] - i).clamp_min(1)
            prefer_s = gain_s * den_v >= gain_v * den_s
        else:  # the paper's prose: raw marginal gains
            prefer_s = gain_s >= gain_v
        take_s = active & can_s & (prefer_s | ~can_v)
        take_v = active & can_v & ~take_s
        total = total + torch.where(take_s, gain_s, zero) + torch.where(take_v, gain_v, zero)  # lines 14/17
        ol_s = ol_s + torch.where(take_s, s_max[ar, si], zero)  # line 13
        ol_v = ol_v + torch.where(take_v, v_max[ar, vj], zero)  # line 16
        if stop is not None:
            c_s = c_s + torch.where(take_s, l_s[ar, si].double(), zero64)
            c_v = c_v + torch.where(take_v, l_v[ar, vj].double(), zero64)
        i, j = i + take_s, j + take_v
    return i, j, total


def greedy_python(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, i, j, total, ol_s, ol_v, cap: int,
                  normalised: bool = True, stop=None):
    """The loop of greedy() unit by unit on Python floats, from the state start() gives.

    The arrays are fp32 and torch computes every step in fp32. Python computes in fp64 and each result
    is rounded to fp32 (through a one-slot array('f')), which gives the fp32 result exactly: a sum,
    difference or product of two fp32 numbers computed in fp64 (53 >= 2 * 24 + 2 bits) and then
    rounded to fp32 is the correctly rounded fp32 result. Comparisons of fp32 values are the same in
    either precision. Each unit's lists are read (tolist) in growing chunks, as far as it gets. The
    early stop's sums (stop, as greedy_torch's) are fp64, Python's own precision."""
    dtype, device = total.dtype, total.device
    if w_s.dtype != torch.float32 or not (w_s.shape[1] and w_v.shape[1]):  # fp32 only, like the emulation
        return greedy_torch(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, i, j, total, ol_s, ol_v, cap,
                            normalised, stop)
    N, Ms = w_s.shape
    Mv = w_v.shape[1]
    slot = array.array("f", [0.0])
    st = [x.tolist() for x in (n_s, n_v, target, i, j, total, ol_s, ol_v)]
    inf = float("inf")
    cells = [x.tolist() for x in stop] if stop is not None else [[0.0] * N, [0.0] * N, [inf] * N]
    rows_s, rows_v = (w_s, s_max, l_s), (w_v, v_max, l_v)
    out_i, out_j, out_total = [], [], []
    for u in range(N):
        ns, nv, goal, ii, jj, tot, os_, ov = (x[u] for x in st)
        cs, cv, limit = (x[u] for x in cells)
        ks = kv = 0  # entries read so far
        while (tot < goal and (ii < ns or jj < nv) and ii + jj < cap
               and (limit == inf or max(cs, cv, cs + cv - float(ii * jj)) < limit)):
            si = ii if ii < Ms else Ms - 1
            vj = jj if jj < Mv else Mv - 1
            if si >= ks:  # read the next chunk: twice what was read, at least 256 and what is needed
                ks = min(Ms, max(2 * ks, 256, si + 1))
                ws, sm, ls = (x[u, :ks].tolist() for x in rows_s)
            if vj >= kv:
                kv = min(Mv, max(2 * kv, 256, vj + 1))
                wv, vm, lv = (x[u, :kv].tolist() for x in rows_v)
            slot[0] = ws[si] - ov  # Alg. 5 line 11
            gain_s = slot[0]
            slot[0] = wv[vj] - os_
            gain_v = slot[0]
            if normalised:  # line 12, cross-multiplied: both denominators are >= 1
                slot[0] = ls[si] - jj
                den_s = slot[0] if slot[0] > 1.0 else 1.0
                slot[0] = lv[vj] - ii
                den_v = slot[0] if slot[0] > 1.0 else 1.0
                slot[0] = gain_s * den_v
                lhs = slot[0]
                slot[0] = gain_v * den_s
                prefer_s = lhs >= slot[0]
            else:
                prefer_s = gain_s >= gain_v
            if ii < ns and (prefer_s or jj >= nv):
                slot[0] = tot + gain_s  # line 14
                tot = slot[0]
                slot[0] = os_ + sm[si]  # line 13
                os_ = slot[0]
                cs += ls[si]
                ii += 1
            else:
                slot[0] = tot + gain_v  # line 17
                tot = slot[0]
                slot[0] = ov + vm[vj]  # line 16
                ov = slot[0]
                cv += lv[vj]
                jj += 1
        out_i.append(ii)
        out_j.append(jj)
        out_total.append(tot)
    as_long = lambda x: torch.tensor(x, dtype=i.dtype, device=device)  # noqa: E731
    return as_long(out_i), as_long(out_j), torch.tensor(out_total, dtype=dtype, device=device)


def chosen(order: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean [N, M] of the first count[n] lines of each unit's sorted order [N, M]."""
    rank = torch.arange(order.shape[1], device=order.device)[None] < count[:, None]
    return torch.zeros_like(rank).scatter_(1, order, rank)
