"""What a forward step records for the methods that score the KV after it: the last queries of each
layer (the observation window) and their positions, and, for a scorer that models every query, their
running pre-RoPE moments."""

from __future__ import annotations

import torch

FLUSH_EVERY = 64  # decode steps held back before they are filed per layer


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, from pinned memory without waiting: a pageable copy would hold the
    host until the GPU finishes the step in flight, and decode runs a step ahead of the host."""
    if host.device == device:
        return host
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


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
        self._moments: QueryMoments | None = None  # set by the recipe for a scorer that reads them

    @property
    def moments(self) -> QueryMoments | None:
        return self._moments

    @moments.setter
    def moments(self, moments: QueryMoments | None) -> None:
        """The running moments; reading them files the steps still pending first."""
        self._moments = moments
        if moments is not None:
            moments.before_read = self.flush

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
        self._observe(layer, q, positions)

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
        # Graphed steps hand their positions in from the host (uploaded in one copy when all are), eager
        # ones on q's device.
        if all(p[1].device != q.device for p in pending):
            positions = _to(torch.cat([p[1] for p in pending]), q.device)
        else:
            positions = torch.cat([_to(p[1], q.device) for p in pending])
        for layer in range(q.shape[0]):
            self._observe(layer, q[layer], positions)

    def _observe(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        if self._moments is not None:
            self._moments.add(layer, q, positions)
        self._file(layer, q, positions)

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
        if self.moments is not None:
            self.moments.clear()

    def truncate(self, num_positions: int) -> None:
        """Forget the queries of positions >= num_positions (a rolled-back turn). The moments are sums:
        they keep what they added (a turn undone with its snapshot restores them exactly)."""
        self.flush()
        for layer, positions in enumerate(self._positions):
            if positions is not None:
                keep = positions < num_positions
                self._queries[layer] = self._queries[layer][keep] if keep.any() else None
                self._positions[layer] = positions[keep] if keep.any() else None

    def snapshot(self) -> tuple:
        """The current window (queries, positions), and the moments' state when there are moments;
        filing replaces tensors rather than mutating them, so this is cheap."""
        self.flush()
        if self.moments is None:
            return list(self._queries), list(self._positions)
        return list(self._queries), list(self._positions), self.moments.state()

    def to_tensors(self, prefix: str = "window") -> dict[str, torch.Tensor]:
        """The window as named tensors, stored with the KV when a conversation leaves the device:
        `{prefix}.q.{layer}` [W, Hq, D] and `{prefix}.pos.{layer}` [W] for each layer that has one, and
        with moments `{prefix}.moments.{count,sum,outer}.{layer}` ([], [Hq, D], [Hq, D, D] float64)."""
        self.flush()
        out = {}
        for layer, (q, positions) in enumerate(zip(self._queries, self._positions)):
            if q is not None:
                out[f"{prefix}.q.{layer}"], out[f"{prefix}.pos.{layer}"] = q, positions
        if self.moments is not None:
            for name, per_layer in zip(("count", "sum", "outer"), self.moments.state()):
                for layer, value in enumerate(per_layer):
                    if value is not None:
                        out[f"{prefix}.moments.{name}.{layer}"] = value
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor], device, prefix: str = "window") -> None:
        """The window to_tensors() stored (copied onto `device`: the stored tensors may be reused)."""
        self._pending = []
        for layer in range(len(self._queries)):
            q = tensors.get(f"{prefix}.q.{layer}")
            self._queries[layer] = None if q is None else q.to(device, copy=True)
            pos = tensors.get(f"{prefix}.pos.{layer}")
            self._positions[layer] = None if pos is None else pos.to(device, copy=True)
        if self.moments is not None:
            n = len(self._queries)
            state = [[tensors.get(f"{prefix}.moments.{name}.{layer}") for layer in range(n)]
                     for name in ("count", "sum", "outer")]
            self.moments.set_state(tuple([None if t is None else t.to(device, copy=True) for t in per_layer]
                                         for per_layer in state))

    def restore(self, snapshot: tuple) -> None:
        self._pending = []
        self._queries, self._positions = list(snapshot[0]), list(snapshot[1])
        if self.moments is not None and len(snapshot) > 2:
            self.moments.set_state(snapshot[2])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unrotate(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries q [T, Hq, D] at positions [T] -> their pre-RoPE form, in float64."""
    angles = positions.double()[:, None] * inv_freq.double().to(q.device)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    q = q.double()
    return q * cos - rotate_half(q) * sin


class QueryMoments:
    """Running moments of every query a conversation computes at positions >= `skip_below`, rotated
    back to their pre-RoPE form, per layer: the count, the sum [Hq, D] and the sum of outer products
    [Hq, D, D], in float64 on the queries' device. Adding replaces the tensors (no in-place update),
    so a state() is a cheap snapshot."""

    def __init__(self, num_layers: int, inv_freq: torch.Tensor, skip_below: int = 0):
        self.inv_freq = inv_freq
        self.skip_below = skip_below
        self.before_read = lambda: None  # the window that feeds them files its pending steps
        self.clear(num_layers)

    def clear(self, num_layers: int | None = None) -> None:
        n = len(self.sums) if num_layers is None else num_layers
        self.counts: list[torch.Tensor | None] = [None] * n
        self.sums: list[torch.Tensor | None] = [None] * n
        self.outers: list[torch.Tensor | None] = [None] * n

    def add(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """q [T, Hq, D] post-RoPE at positions [T] (no host read of either)."""
        positions = positions.to(q.device)
        pre = unrotate(q, positions, self.inv_freq)
        w = (positions >= self.skip_below).double()
        count, total, outer = w.sum(), torch.einsum("t,thd->hd", w, pre), torch.einsum("t,thd,the->hde", w, pre, pre)
        if self.counts[layer] is not None:
            count, total, outer = count + self.counts[layer], total + self.sums[layer], outer + self.outers[layer]
        self.counts[layer], self.sums[layer], self.outers[layer] = count, total, outer

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(count [], sum [Hq, D], outer-product sum [Hq, D, D]) of `layer`, or None before any query."""
        self.before_read()
        if self.counts[layer] is None:
            return None
        return self.counts[layer], self.sums[layer], self.outers[layer]

    def state(self) -> tuple[list, list, list]:
        self.before_read()
        return list(self.counts), list(self.sums), list(self.outers)

    def set_state(self, state: tuple[list, list, list]) -> None:
        self.counts, self.sums, self.outers = (list(x) for x in state)
