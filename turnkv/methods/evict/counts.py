"""Per-head token counts for the allocators: what must stay, what may compete, and integer counts
that meet each layer's budget exactly."""

from __future__ import annotations

import numpy as np
import torch


def protected_and_capacity(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of [..., H, S] scores on any device: tokens that must stay (+inf) and tokens free to
    compete (finite), as [..., H] int64 on the CPU (read back together)."""
    protected, free = torch.stack([torch.isposinf(scores).sum(dim=-1), torch.isfinite(scores).sum(dim=-1)]).cpu()
    return protected, free


def fit_counts(desired, capacity, total) -> torch.Tensor:
    """Integer counts <= capacity, summing to min(total, capacity.sum()), close to `desired` (float):
    floors first, then one more for the largest remainders (ties: the lower head first), then any
    shortfall to heads that still have room. desired, capacity [H] and total an int -> [H], or
    [T, H] and [T] -> [T, H] (one layer per row); int64 on the CPU."""
    desired = np.clip(torch.as_tensor(desired).double().cpu().numpy(), 0, None)
    one = desired.ndim == 1
    desired = np.atleast_2d(desired)
    capacity = np.atleast_2d(torch.as_tensor(capacity).cpu().numpy().astype(np.int64))
    totals = np.minimum(np.asarray(total, np.int64).reshape(-1), capacity.sum(axis=1))
    floors = np.floor(desired)
    counts = np.minimum(floors.astype(np.int64), capacity)
    order = np.argsort(floors - desired, axis=1, kind="stable")  # the largest remainder first
    room = np.take_along_axis(counts < capacity, order, axis=1)
    give = room & (np.cumsum(room, axis=1) <= (totals - counts.sum(axis=1))[:, None])
    np.put_along_axis(counts, order, np.take_along_axis(counts, order, axis=1) + give, axis=1)
    for t in np.flatnonzero(totals != counts.sum(axis=1)):
        _settle(counts[t], capacity[t], int(totals[t] - counts[t].sum()))
    return torch.from_numpy(counts[0] if one else counts)


def _settle(counts: np.ndarray, capacity: np.ndarray, left: int) -> None:
    """Give `left` more tokens (or take -left back) among one layer's heads [H], in place."""
    while left > 0:  # heads at capacity pass their share to the heads that still have room
        open_heads = np.flatnonzero(capacity > counts)
        share = -(-left // len(open_heads))
        for i in open_heads:
            give = min(int(capacity[i] - counts[i]), share, left)
            counts[i] += give
            left -= give
    while left < 0:  # floors above the total (tiny budgets): take back from the largest
        counts[int(counts.argmax())] -= 1
        left += 1
