"""What a forward step records for the methods that score the KV after it: the last queries of each
layer (the observation window) and their positions."""

from __future__ import annotations

import torch

FLUSH_EVERY = 64  # decode steps held back before they are filed per layer


class QueryWindow:
    """The last `size` post-RoPE queries of every layer for one conversation, across steps.

    Decode steps hand in all layers at once (record_all): one copy per step, filed per layer only
    when someone reads the window or FLUSH_EVERY steps have piled up, so observing costs a decode
    step almost nothing."""

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self._queries: list[torch.Tensor | None] = [None] * num_layers  # [W, Hq, D]
        self._positions: list[torch.Tensor | None] = [None] * num_layers  # [W]
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # ([L, T, Hq, D], [T])

    @property
    def queries(self) -> list[torch.Tensor | None]:
        self.flush()
        return self._queries

    @property
    def positions(self) -> list[torch.Tensor | None]:
        self.flush()
        return self._positions

    def record(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """q: [T, Hq, D], positions: [T]."""
        self.flush()
        self._file(layer, q, positions)

    def record_all(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Every layer's queries of one step: q [L, T, Hq, D], positions [T] (on q's device or on
        the CPU: a decode step passes them from the host, which moves them at the next flush)."""
        self._pending.append((q.detach().clone(), positions.clone()))
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        q = torch.cat([p[0] for p in pending], dim=1)
        positions = torch.cat([p[1].cpu() if p[1].device != q.device else p[1] for p in pending])
        if positions.device != q.device:
            # From pinned memory, without waiting: a pageable copy would hold the host until the GPU
            # finishes the step in flight, and decode runs a step ahead of the host (decode_loop.py).
            positions = positions.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else positions.to(q.device)
        for layer in range(q.shape[0]):
            self._file(layer, q[layer], positions)

    def _file(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Subclasses that keep more than the window hook in here."""
        if self._queries[layer] is not None and q.shape[0] < self.size:
            q = torch.cat([self._queries[layer], q])
            positions = torch.cat([self._positions[layer], positions])
        self._queries[layer] = q[-self.size :].detach().clone()
        self._positions[layer] = positions[-self.size :].clone()

    def clear(self) -> None:
        self._pending = []
        self._queries = [None] * len(self._queries)
        self._positions = [None] * len(self._positions)

    def truncate(self, num_positions: int) -> None:
        """Forget the queries of positions >= num_positions (a rolled-back turn)."""
        self.flush()
        for layer, positions in enumerate(self._positions):
            if positions is not None:
                keep = positions < num_positions
                self._queries[layer] = self._queries[layer][keep] if keep.any() else None
                self._positions[layer] = positions[keep] if keep.any() else None

    def snapshot(self) -> tuple[list, list]:
        """The current window; filing replaces tensors rather than mutating them, so this is cheap."""
        self.flush()
        return list(self._queries), list(self._positions)

    def to_tensors(self, prefix: str = "window") -> dict[str, torch.Tensor]:
        """The window as named tensors, stored with the KV when a conversation leaves the device:
        `{prefix}.q.{layer}` [W, Hq, D] and `{prefix}.pos.{layer}` [W] for each layer that has one."""
        self.flush()
        out = {}
        for layer, (q, positions) in enumerate(zip(self._queries, self._positions)):
            if q is not None:
                out[f"{prefix}.q.{layer}"], out[f"{prefix}.pos.{layer}"] = q, positions
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor], device, prefix: str = "window") -> None:
        """The window to_tensors() stored (copied onto `device`: the stored tensors may be reused)."""
        self._pending = []
        for layer in range(len(self._queries)):
            q = tensors.get(f"{prefix}.q.{layer}")
            self._queries[layer] = None if q is None else q.to(device, copy=True)
            pos = tensors.get(f"{prefix}.pos.{layer}")
            self._positions[layer] = None if pos is None else pos.to(device, copy=True)

    def restore(self, snapshot: tuple[list, list]) -> None:
        self._pending = []
        self._queries, self._positions = list(snapshot[0]), list(snapshot[1])
