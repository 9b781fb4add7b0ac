"""What a forward step records for the methods that score the KV after it: the last queries of each
layer (the observation window) and their positions."""

from __future__ import annotations

import torch


class QueryWindow:
    """The last `size` post-RoPE queries of every layer for one conversation, across steps."""

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.queries: list[torch.Tensor | None] = [None] * num_layers  # [W, Hq, D]
        self.positions: list[torch.Tensor | None] = [None] * num_layers  # [W]

    def record(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """q: [T, Hq, D], positions: [T]."""
        if self.queries[layer] is not None and q.shape[0] < self.size:
            q = torch.cat([self.queries[layer], q])
            positions = torch.cat([self.positions[layer], positions])
        self.queries[layer] = q[-self.size :].detach().clone()
        self.positions[layer] = positions[-self.size :].clone()

    def clear(self) -> None:
        self.queries = [None] * len(self.queries)
        self.positions = [None] * len(self.positions)

    def truncate(self, num_positions: int) -> None:
        """Forget the queries of positions >= num_positions (a rolled-back turn)."""
        for layer, positions in enumerate(self.positions):
            if positions is not None:
                keep = positions < num_positions
                self.queries[layer] = self.queries[layer][keep] if keep.any() else None
                self.positions[layer] = positions[keep] if keep.any() else None

    def snapshot(self) -> tuple[list, list]:
        """The current window; record() replaces tensors rather than mutating them, so this is cheap."""
        return list(self.queries), list(self.positions)

    def restore(self, snapshot: tuple[list, list]) -> None:
        self.queries, self.positions = list(snapshot[0]), list(snapshot[1])
