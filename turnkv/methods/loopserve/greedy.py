"""The greedy of Algorithm 5 (spec loopserve.md §3.2.3-§3.2.4), batched over selection units.

Each unit (a head) holds its slash and vertical lines sorted by descending sum. The greedy always takes
the head of one list, so after it stops the selected lines are the first `i` slash and the first `j`
vertical lines of the sorted orders: its result is two counts per unit. Every quantity its comparison
needs at (i, j) is a prefix of the sorted arrays, so one iteration advances every unit by one line with
a few gathers, and there is no per-unit Python loop.
"""

from __future__ import annotations

import torch

CHECK_EVERY = 32  # iterations between the host reads that stop the loop once every unit is done


def prefix(x: torch.Tensor) -> torch.Tensor:
    """[N, M] -> [N, M + 1] running sums with a leading zero: prefix(x)[:, k] = sum of the first k."""
    return torch.nn.functional.pad(x.cumsum(dim=1), (1, 0))


def greedy(w_s, s_max, l_s, n_s, w_v, v_max, l_v, n_v, target, forced_s, forced_v,
           normalised: bool = True, max_lines: int | None = None):
    """Counts (i, j) of slash and vertical lines taken, and the estimated mass they cover.

    w_s, s_max, l_s [N, Ms]: slash sums, largest entries and lengths in descending order of w_s (forced
    lines first); w_v, v_max, l_v [N, Mv] likewise for vertical lines. n_s, n_v [N]: lines available
    (padding after them). target [N]: alpha times the sampled mass. forced_s, forced_v [N]: the forced
    lines at the front, taken before the greedy starts. The estimate subtracts w^max of the other kind
    of line already taken (ol_s, ol_v): a slash and a vertical line share at most one cell, so it never
    exceeds the mass really covered (spec §3.2.4)."""
    N = w_s.shape[0]
    ps_w, ps_max, pv_w, pv_max = prefix(w_s), prefix(s_max), prefix(w_v), prefix(v_max)
    i, j = forced_s.clone(), forced_v.clone()
    ar = torch.arange(N, device=w_s.device)
    ol_s, ol_v = ps_max[ar, i], pv_max[ar, j]
    # Forced lines counted as if all slash lines came first, then the vertical ones.
    total = ps_w[ar, i] + pv_w[ar, j] - j * ol_s
    cap = torch.full_like(i, max_lines if max_lines is not None else w_s.shape[1] + w_v.shape[1])
    zero = torch.zeros_like(total)
    for it in range(w_s.shape[1] + w_v.shape[1]):
        can_s, can_v = i < n_s, j < n_v
        active = (total < target) & (can_s | can_v) & (i + j < cap)
        if it % CHECK_EVERY == 0 and not bool(active.any()):
            break
        si, vj = i.clamp_max(w_s.shape[1] - 1), j.clamp_max(w_v.shape[1] - 1)
        gain_s = w_s[ar, si] - ol_v  # Alg. 5 line 11
        gain_v = w_v[ar, vj] - ol_s
        if normalised:  # line 12, cross-multiplied: both denominators are >= 1
            den_s = (l_s[ar, si] - j).clamp_min(1)
            den_v = (l_v[ar, vj] - i).clamp_min(1)
            prefer_s = gain_s * den_v >= gain_v * den_s
        else:  # the §5.1 prose: raw marginal gains
            prefer_s = gain_s >= gain_v
        take_s = active & can_s & (prefer_s | ~can_v)
        take_v = active & can_v & ~take_s
        total = total + torch.where(take_s, gain_s, zero) + torch.where(take_v, gain_v, zero)  # lines 14/17
        ol_s = ol_s + torch.where(take_s, s_max[ar, si], zero)  # line 13
        ol_v = ol_v + torch.where(take_v, v_max[ar, vj], zero)  # line 16
        i, j = i + take_s, j + take_v
    return i, j, total


def chosen(order: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean [N, M] of the first count[n] lines of each unit's sorted order [N, M]."""
    rank = torch.arange(order.shape[1], device=order.device)[None] < count[:, None]
    return torch.zeros_like(rank).scatter_(1, order, rank)
