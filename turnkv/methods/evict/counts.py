"""Per-head token counts for the allocators: what must stay, what may compete, and integer counts
that meet a layer's budget exactly."""

from __future__ import annotations

import torch


def protected_and_capacity(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of [..., H, S] scores on any device: tokens that must stay (+inf) and tokens free to
    compete (finite), as [..., H] int64 on the CPU (read back together)."""
    protected, free = torch.stack([torch.isposinf(scores).sum(dim=-1), torch.isfinite(scores).sum(dim=-1)]).cpu()
    return protected, free


def fit_counts(desired: torch.Tensor, capacity: torch.Tensor, total: int) -> torch.Tensor:
    """Integer counts <= capacity, summing to min(total, capacity.sum()), close to `desired` (float):
    floors first, then the largest remainders, then any shortfall to heads that still have room."""
    total = min(int(total), int(capacity.sum()))
    desired = desired.double().clamp(min=0)
    counts = torch.minimum(desired.floor().long(), capacity)
    left = total - int(counts.sum())
    if left > 0:
        order = (desired - desired.floor()).argsort(descending=True)
        for i in order.tolist():
            if left == 0:
                break
            if counts[i] < capacity[i]:
                counts[i] += 1
                left -= 1
    while left > 0:  # heads at capacity pass their share to the heads that still have room
        room = capacity - counts
        open_heads = (room > 0).nonzero().flatten().tolist()
        share = -(-left // len(open_heads))
        for i in open_heads:
            give = min(int(room[i]), share, left)
            counts[i] += give
            left -= give
    while left < 0:  # floors above the total (tiny budgets): take back from the largest
        i = int(counts.argmax())
        counts[i] -= 1
        left += 1
    return counts
