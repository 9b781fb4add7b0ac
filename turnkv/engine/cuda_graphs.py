"""Decode steps replayed from CUDA graphs, one per batch-size bucket (as nano-vllm does).

A decode step launches a few hundred small kernels; at batch 1 the CPU cannot issue them as fast as
the GPU runs them. A graph records the whole step once and replays it with one launch. Everything
that changes between steps lives in static buffers the graph reads. The attention kernel reads the
lengths on the device and its grid is fixed, so one graph serves any lengths up to its capacity.

The host side of a step is one upload: the new tokens' slots, the lengths, the positions and the
page-table cells that changed since the last step go into a pinned buffer and cross in one
asynchronous copy; the graph itself scatters them into place. Nothing in a step waits for the GPU,
so the CPU prepares step n+1 while step n runs (a copy from pageable memory would wait).

Rows of a bucket beyond the live batch get length 0 (their attention reads nothing) and write their
K/V into a page set aside for that purpose.
"""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.model.decoder import Transformer

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class _GraphStep:
    """The decoder's AttentionStep over the static buffers of one bucket."""

    def __init__(self, runner: GraphedDecode, batch: int):
        r = runner
        self.pool, self.batch, self.window = r.pool, batch, r.sliding_window
        H = r.pool.num_kv_heads
        self.slots = r.slots[:, : batch * H]
        self.tables, self.lengths = r.tables[:, :batch], r.lengths[:, :batch]
        self.positions = r.positions[:batch]
        self.queries = r.queries[:, :batch]
        self.splits = decode.num_splits(r.pool.device, batch * H, r.capacity)
        Hq, D = r.queries.shape[2], r.queries.shape[3]
        self.workspace = (torch.empty(batch * Hq * self.splits * D, device=r.pool.device),
                          torch.empty(batch * Hq * self.splits, device=r.pool.device))

    def attention(self, layer, q, k, v):
        B, _, Hq, D = q.shape
        self.pool.write(layer, self.slots[layer], k.transpose(1, 2).reshape(-1, D), v.transpose(1, 2).reshape(-1, D))
        self.queries[layer].copy_(q[:, 0])  # kept for the methods' observation windows
        out = decode.indexed_decode(q[:, 0], self.pool.k[layer], self.pool.v[layer], self.tables[layer],
                                    self.lengths[layer], self.splits, window=self.window,
                                    key_positions=self.pool.positions[layer], query_positions=self.positions,
                                    workspace=self.workspace)
        return out[:, None]


class GraphedDecode:
    def __init__(self, model: Transformer, pool: PagePool, max_model_len: int, max_batch: int = 32):
        self.model, self.pool = model, pool
        self.sliding_window = model.config.sliding_window
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.capacity = max_model_len
        L, H, D, Hq = pool.num_layers, pool.num_kv_heads, pool.head_dim, model.config.num_heads
        B, dev = max_batch, pool.device
        P = -(-max_model_len // pool.page_size)
        # One page per layer, held for good, absorbs the writes of padding rows.
        self.trash_pages = np.array([pages[0] for pages in pool.allocate([1] * L)], dtype=np.int64)
        self.input_ids = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.tables_flat = torch.zeros(L * B * H * P + 1, dtype=torch.int32, device=dev)  # + a trash cell
        self.tables = self.tables_flat[:-1].view(L, B, H, P)
        self.lengths = torch.zeros(L, B, H, dtype=torch.int32, device=dev)
        self.queries = torch.zeros(L, B, Hq, D, dtype=pool.dtype, device=dev)
        # The per-step upload: slots [L, B*H], lengths [L, B, H], positions [B], then up to
        # max_updates (flat table cell, page id) pairs: a step adds at most one page per head.
        self.max_updates = L * B * H
        sizes = [L * B * H, L * B * H, B, self.max_updates, self.max_updates]
        self.meta = torch.zeros(sum(sizes), dtype=torch.int64, device=dev)
        slots, lengths64, positions, upd_cell, upd_page = self.meta.split(sizes)
        self.slots, self.lengths64, self.positions = slots.view(L, B * H), lengths64.view(L, B, H), positions
        self.update_cells, self.update_pages = upd_cell, upd_page
        pinned = dev.type == "cuda"
        self.staging = [torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.uploaded = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.turn = 0
        self.sizes = sizes
        self.rows: list[tuple[SequenceKV, int, np.ndarray] | None] = [None] * B  # (seq, shrinks, pages uploaded)
        self.layer_base = torch.arange(L, device=dev)[:, None] * pool.positions[0].numel()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, _GraphStep]] = {}
        self.memory_pool = None

    def close(self) -> None:
        for layer, page in enumerate(self.trash_pages):
            self.pool.release(layer, [int(page)])
        self.graphs.clear()

    def fits(self, seqs: list[SequenceKV]) -> bool:
        return len(seqs) <= self.buckets[-1] and max(s.next_position for s in seqs) < self.capacity

    @torch.inference_mode()
    def step(self, seqs: list[SequenceKV], token_ids: torch.Tensor) -> torch.Tensor:
        """Reserve one token in each sequence and run the decode step: token_ids [B] (on the device)
        -> fp32 logits [B, V] (a view of the graph's output: use it before the next step). On an
        error nothing is reserved."""
        B, L, H = len(seqs), self.pool.num_layers, self.pool.num_kv_heads
        bucket = next(b for b in self.buckets if b >= B)
        reserved = []
        try:
            for s in seqs:
                reserved.append(s.reserve_on_host(1)[:, :, 0])  # [L, H]
        except BaseException:
            for s in seqs[: len(reserved)]:
                s.truncate(s.next_position - 1)
            raise
        try:
            return self._step(seqs, token_ids, reserved, bucket)
        except BaseException:
            for s in seqs:
                s.truncate(s.next_position - 1)
            raise

    def _step(self, seqs, token_ids, reserved, bucket):
        B, L, H = len(seqs), self.pool.num_layers, self.pool.num_kv_heads
        k = self.turn % 2
        self.turn += 1
        if self.uploaded is not None:
            self.uploaded[k].synchronize()  # the copy that last read this staging buffer is done
        host = self.staging[k].numpy()
        slots, lengths, positions, cells, pages = np.split(host, np.cumsum(self.sizes)[:-1])
        slots, lengths = slots.reshape(L, -1, H), lengths.reshape(L, -1, H)
        slots[:, :B] = np.stack(reserved, axis=1)
        slots[:, B:bucket] = self.trash_pages[:, None, None] * self.pool.page_size
        lengths[:, :B] = np.stack([s.lengths for s in seqs], axis=1)
        lengths[:, B:bucket] = 0
        positions[:B] = [s.next_position - 1 for s in seqs]
        positions[B:bucket] = 0
        n = self._table_updates(seqs, cells, pages)
        cells[n:] = self.tables_flat.numel() - 1  # unused pairs write the trash cell
        self.meta.copy_(self.staging[k], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded[k].record()
        self.input_ids[:B, 0].copy_(token_ids.view(B))
        self.input_ids[B:bucket].zero_()
        if self.pool.device.type != "cuda":  # the same steps without a graph: how CPU tests check them
            return self._run(bucket, _GraphStep(self, bucket))[:B, 0]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits, _ = self.graphs[bucket]
        graph.replay()
        return logits[:B, 0]

    def _table_updates(self, seqs, cells, pages) -> int:
        """Fill (cell, page) pairs for the table columns each row gained since the last step. A row that
        changed sequence, or whose sequence released pages, gets its whole table copied right away."""
        L, H, P = self.pool.num_layers, self.pool.num_kv_heads, self.tables.shape[3]
        B_max = self.tables.shape[1]
        n = 0
        for b, seq in enumerate(seqs):
            row = self.rows[b]
            if row is None or row[0] is not seq or row[1] != seq.shrinks or (seq.num_pages - row[2] > 1).any():
                width = min(int(seq.num_pages.max(initial=0)), P)
                self.tables[:, b, :, :width].copy_(torch.from_numpy(seq.table[:, :, :width]))
                self.rows[b] = (seq, seq.shrinks, seq.num_pages.copy())
                continue
            grown = np.nonzero(seq.num_pages > row[2])
            count = len(grown[0])
            if count:
                layer, head = grown
                col = row[2][layer, head]
                cells[n : n + count] = ((layer * B_max + b) * H + head) * P + col
                pages[n : n + count] = seq.table[layer, head, col]
                n += count
                row[2][layer, head] += 1
        return n

    def _prepare(self, batch: int) -> None:
        """Inside the graph: put the uploaded metadata in place."""
        H = self.pool.num_kv_heads
        self.tables_flat.index_copy_(0, self.update_cells, self.update_pages.to(torch.int32))
        self.lengths[:, :batch].copy_(self.lengths64[:, :batch])
        flat = (self.slots[:, : batch * H] + self.layer_base).reshape(-1)
        positions = self.positions[:batch].repeat_interleave(H).repeat(self.pool.num_layers)
        self.pool.positions.view(-1).index_copy_(0, flat, positions)
        self.pool.attention_mass.view(-1).index_fill_(0, flat, 0.0)

    def _run(self, batch: int, step: _GraphStep):
        self._prepare(batch)
        return self.model(self.input_ids[:batch], self.positions[:batch, None], step)

    def _capture(self, batch: int):
        step = _GraphStep(self, batch)
        # Warm up outside the graph: Triton compiles its kernels on the first call. The warm-up runs
        # the real step (same writes as the replay that follows).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(batch, step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self._run(batch, step)
        return graph, logits, step

    def record_windows(self, seqs: list[SequenceKV], windows: list) -> None:
        """Hand the step's queries to the observation windows of the conversations that keep one."""
        for b, (seq, window) in enumerate(zip(seqs, windows)):
            if window is not None:
                position = torch.tensor([seq.next_position - 1], device=self.pool.device)
                window.record_all(self.queries[:, b, None], position)
