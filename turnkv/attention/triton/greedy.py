"""LoopServe's greedy line selection (Algorithm 5 lines 9-17) on the device.

One program per selection unit (a head) runs the sequential loop of
turnkv.methods.loopserve.greedy.greedy_torch on scalars: each step loads the next entry of the unit's
two sorted lists (slash and vertical), makes the same fp32 comparison and the same updates, and stops
when the unit reaches its target, runs out of lines or hits the cap. Its (i, j, total) equal the torch
loop's exactly: every operation is the torch loop's, in the same order and precision, and
floating-point contraction (a*b + c -> fma) is turned off at compile time.

The torch loop advances every unit by one line per iteration (about twenty small launches, and a host
read every CHECK_EVERY iterations to stop); here the whole loop is one launch with no host read, and a
unit stops as soon as it is done. A step's loads depend on the last step's comparison, but each list
is walked in order, so they mostly hit the L1 cache, which is why the lists are not held in registers
(picking entries out of a block with masked sums costs more than the cached loads).

With STOP, a unit also stops once the lower bound of its taken lines' cells reaches its stop_cells
(the early stop of turnkv.methods.loopserve.greedy): the fp64 sums of the lengths taken, updated and
compared in the torch loop's operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bound(c_s, c_v, i, j):
    """max(c_s, c_v, c_s + c_v - i*j) in fp64, as greedy.bound() computes it."""
    return tl.maximum(tl.maximum(c_s, c_v), c_s + c_v - i.to(tl.float64) * j.to(tl.float64))


@triton.jit
def _greedy(
    w_s_ptr, s_max_ptr, l_s_ptr, w_v_ptr, v_max_ptr, l_v_ptr,
    n_s_ptr, n_v_ptr, target_ptr,
    i_ptr, j_ptr, total_ptr, ol_s_ptr, ol_v_ptr,
    c_s_ptr, c_v_ptr, stop_ptr,
    Ms, Mv, cap,
    NORMALISED: tl.constexpr, STOP: tl.constexpr,
):
    u = tl.program_id(0)
    s_base = u.to(tl.int64) * Ms
    v_base = u.to(tl.int64) * Mv
    n_s = tl.load(n_s_ptr + u)
    n_v = tl.load(n_v_ptr + u)
    target = tl.load(target_ptr + u)
    i = tl.load(i_ptr + u)
    j = tl.load(j_ptr + u)
    total = tl.load(total_ptr + u)
    ol_s = tl.load(ol_s_ptr + u)
    ol_v = tl.load(ol_v_ptr + u)
    active = (total < target) & ((i < n_s) | (j < n_v)) & (i + j < cap)
    if STOP:
        c_s = tl.load(c_s_ptr + u)
        c_v = tl.load(c_v_ptr + u)
        stop = tl.load(stop_ptr + u)
        active = active & (_bound(c_s, c_v, i, j) < stop)
    while active:
        can_s = i < n_s
        can_v = j < n_v
        si = tl.minimum(i, Ms - 1)
        vj = tl.minimum(j, Mv - 1)
        gain_s = tl.load(w_s_ptr + s_base + si) - ol_v  # Alg. 5 line 11
        gain_v = tl.load(w_v_ptr + v_base + vj) - ol_s
        if NORMALISED or STOP:
            len_s = tl.load(l_s_ptr + s_base + si)
            len_v = tl.load(l_v_ptr + v_base + vj)
        if NORMALISED:  # line 12, cross-multiplied: both denominators are >= 1
            den_s = tl.maximum(len_s - j.to(tl.float32), 1.0)
            den_v = tl.maximum(len_v - i.to(tl.float32), 1.0)
            prefer_s = gain_s * den_v >= gain_v * den_s
        else:  # raw marginal gains, as the paper's prose states them
            prefer_s = gain_s >= gain_v
        take_s = can_s & (prefer_s | (can_v == 0))
        total = tl.where(take_s, total + gain_s, total + gain_v)  # lines 14/17
        ol_s = tl.where(take_s, ol_s + tl.load(s_max_ptr + s_base + si), ol_s)  # line 13
        ol_v = tl.where(take_s, ol_v, ol_v + tl.load(v_max_ptr + v_base + vj))  # line 16
        step = take_s.to(tl.int32)
        i = i + step
        j = j + (1 - step)
        active = (total < target) & ((i < n_s) | (j < n_v)) & (i + j < cap)
        if STOP:
            c_s = tl.where(take_s, c_s + len_s.to(tl.float64), c_s)
            c_v = tl.where(take_s, c_v, c_v + len_v.to(tl.float64))
            active = active & (_bound(c_s, c_v, i, j) < stop)
    tl.store(i_ptr + u, i)
    tl.store(j_ptr + u, j)
    tl.store(total_ptr + u, total)


def greedy(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, i, j, total, ol_s, ol_v, cap: int,
           normalised: bool = True, stop=None):
    """Runs the greedy from the state (i, j, total, ol_s, ol_v) [N] (the forced lines taken) to the end.

    w_s, s_max, l_s [N, Ms] and w_v, v_max, l_v [N, Mv]: the sorted lists; n_s, n_v [N] lines available;
    target [N]; cap: lines per unit; stop: None or (c_s, c_v, stop_cells) [N], the early stop's state
    (greedy.start_cells()). Returns (i, j, total) [N], in the dtypes of i and total."""
    N, Ms = w_s.shape
    Mv = w_v.shape[1]
    f32 = lambda x: x.to(torch.float32).contiguous()  # noqa: E731
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    i_out, j_out = i32(i).clone(), i32(j).clone()
    total_out = f32(total).clone()
    f64 = lambda x: x.to(torch.float64).contiguous()  # noqa: E731
    cells = tuple(map(f64, stop)) if stop is not None else (total_out,) * 3  # unread without a stop
    if N:
        _greedy[(N,)](
            f32(w_s), f32(s_max), f32(l_s), f32(w_v), f32(v_max), f32(l_v),
            i32(n_s), i32(n_v), f32(target),
            i_out, j_out, total_out, f32(ol_s), f32(ol_v), *cells,
            Ms, Mv, min(int(cap), Ms + Mv),
            NORMALISED=normalised, STOP=stop is not None, num_warps=1, num_stages=1, enable_fp_fusion=False,
        )
    return i_out.to(i.dtype), j_out.to(j.dtype), total_out.to(total.dtype)
