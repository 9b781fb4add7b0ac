"""What the selection graphs of both kinds share (engine/graph_selection.py): a conversation's record in
a handler's buffers, the per-step upload of host metadata, and capture and replay of the handler's
own graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from turnkv.engine.cuda_graphs import GraphedDecode

MAX_WHOLE_PAGES = 1 << 14  # physical pages a whole-list row may need before the step goes eager


@dataclasses.dataclass
class Plan:
    """variant(bucket, B) -> logits replaces GraphedDecode's replay (None: the plain graph);
    after(seqs) runs once the step succeeded. Making a plan changes nothing that the eager step reads
    otherwise (its writes wait for variant): a plan that is not run (another tensor-parallel rank had
    none) is dropped as is, and the eager step then runs as where the plan was None."""

    variant: object
    after: object


class Record:
    """A conversation's selection in a handler's buffers: which row, as of which begin() (ticks)."""

    def __init__(self, handler, num_layers: int, num_heads: int):
        self.handler = handler
        self.row: int | None = None
        self.ticks = -1
        self.version = -1
        self.valid = np.zeros(num_layers, dtype=bool)
        self.age = np.zeros(num_layers, dtype=np.int64)
        self.pages = np.zeros((num_layers, num_heads), dtype=np.int64)


class Upload:
    """A handler's per-step metadata: int64 arrays filled on the host in a pinned staging buffer (two,
    alternating) and sent in one asynchronous copy into a device buffer the graphs read."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = sizes
        self.buffer = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        self.views = self.buffer.split(sizes)
        pinned = device.type == "cuda"
        self.staging = [torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.turn = 0

    def host(self) -> list[np.ndarray]:
        k = self.turn % 2
        if self.events is not None:
            self.events[k].synchronize()  # the copy that last read this staging buffer is done
        return np.split(self.staging[k].numpy(), np.cumsum(self.sizes)[:-1])

    def send(self) -> None:
        k = self.turn % 2
        self.buffer.copy_(self.staging[k], non_blocking=True)
        if self.events is not None:
            self.events[k].record()
        self.turn += 1


class Handler:
    """What both kinds share: records, row ownership, capture and replay of their own graphs."""

    usable = True

    def __init__(self, graphs: GraphedDecode):
        self.graphs = graphs
        pool = graphs.pool
        self.L, self.H, self.B_max = pool.num_layers, pool.num_kv_heads, graphs.tables.shape[1]
        self.device = pool.device
        self.owner: list = [None] * self.B_max  # the selection state whose data each buffer row holds
        self.graphs_by_key: dict = {}

    def record(self, sel) -> Record:
        rec = sel.graph_record
        if rec is None or rec.handler is not self:
            rec = sel.graph_record = Record(self, self.L, self.H)
        return rec

    def in_buffers(self, sel, rec: Record) -> bool:
        """Whether the buffers still hold this conversation's data, written at its last begin()."""
        return rec.row is not None and rec.ticks == sel.ticks and self.owner[rec.row] is sel

    def move_rows(self, buffers: list[torch.Tensor], moves: list[tuple[int, int]]) -> None:
        """Copy rows (dim 1) of the buffers from src to dst for conversations that changed row."""
        if not moves:
            return
        dst = torch.tensor([d for _, d in moves], device=self.device)
        src = torch.tensor([s for s, _ in moves], device=self.device)
        for buf in buffers:
            buf[:, dst] = buf[:, src]  # the right side is gathered first

    def replay(self, key, bucket: int, B: int, make_step):
        if self.device.type != "cuda":  # the same steps without a graph: how CPU tests check them
            return self._run(bucket, make_step())[:B, 0]
        if key not in self.graphs_by_key:
            self.graphs_by_key[key] = self._capture(bucket, make_step())
        graph, logits, _ = self.graphs_by_key[key]
        graph.replay()
        return logits[:B, 0]

    def _run(self, bucket: int, step):
        g = self.graphs
        g._prepare(bucket)
        step.prepare()
        return g.model(g.input_ids[:bucket], g.positions[:bucket, None], step)

    def _capture(self, bucket: int, step):
        graph, logits = self.graphs.capture(lambda: self._run(bucket, step))
        return graph, logits, step
