"""Decode steps replayed from CUDA graphs, one per batch-size bucket (as nano-vllm does).

A decode step launches a few hundred small kernels; at batch 1 the CPU cannot issue them as fast as
the GPU runs them. A graph records the whole step once and replays it with one launch. Everything
that changes between steps lives in static buffers the graph reads: token ids, positions, the slots
each layer writes, the page tables and lengths. The attention kernel reads the lengths on the device
and its grid is fixed, so one graph serves any lengths up to the capacity it was built for.

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
        self.positions = r.positions[:batch, 0]
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
        # One page per layer, held for good, absorbs the writes of padding rows.
        self.trash_pages = [pages[0] for pages in pool.allocate([1] * L)]
        self.trash_slots = torch.tensor(self.trash_pages, device=dev)[:, None] * pool.page_size  # [L, 1]
        self.input_ids = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(L, B * H, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(L, B, H, -(-max_model_len // pool.page_size), dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(L, B, H, dtype=torch.int32, device=dev)
        self.queries = torch.zeros(L, B, Hq, D, dtype=pool.dtype, device=dev)
        # bucket -> (graph, its output logits, its step): the step owns the workspace the graph writes,
        # so it must live as long as the graph.
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, _GraphStep]] = {}
        self.memory_pool = None

    def close(self) -> None:
        for layer, page in enumerate(self.trash_pages):
            self.pool.release(layer, [page])
        self.graphs.clear()

    def fits(self, seqs: list[SequenceKV]) -> bool:
        return len(seqs) <= self.buckets[-1] and max(s.next_position for s in seqs) < self.capacity

    @torch.inference_mode()
    def step(self, seqs: list[SequenceKV], token_ids: torch.Tensor, slots: list[torch.Tensor]) -> torch.Tensor:
        """Run one decode step for seqs, whose slots for the new token are already reserved.
        token_ids [B, 1] -> fp32 logits [B, V] (a view of the graph's output: use before the next step)."""
        B, H = len(seqs), self.pool.num_kv_heads
        bucket = next(b for b in self.buckets if b >= B)
        self.input_ids[:B].copy_(token_ids.view(B, 1))
        self.positions[:B, 0].copy_(torch.tensor([s.next_position - 1 for s in seqs]), non_blocking=True)
        self.slots[:, : B * H].copy_(torch.stack(slots, dim=1).view(self.pool.num_layers, B * H))
        lengths = np.stack([s.lengths for s in seqs], axis=1)  # [L, B, H]
        self.lengths[:, :B].copy_(torch.from_numpy(lengths.astype(np.int32)), non_blocking=True)
        for b, seq in enumerate(seqs):
            table = seq.device_table()
            width = min(table.shape[2], self.tables.shape[3])
            self.tables[:, b, :, :width].copy_(table[:, :, :width])
        if bucket > B:
            self.input_ids[B:bucket].zero_()
            self.positions[B:bucket].zero_()
            self.slots[:, B * H : bucket * H].copy_(self.trash_slots.expand(-1, (bucket - B) * H))
            self.lengths[:, B:bucket].zero_()
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits, _ = self.graphs[bucket]
        graph.replay()
        return logits[:B, 0]

    def _capture(self, batch: int):
        step = _GraphStep(self, batch)
        ids, pos = self.input_ids[:batch], self.positions[:batch]
        # Warm up outside the graph: Triton compiles its kernels on the first call.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(ids, pos, step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self.model(ids, pos, step)
        return graph, logits, step

    def record_windows(self, seqs: list[SequenceKV], windows: list) -> None:
        """Hand the step's queries to the observation windows of the conversations that keep one."""
        for b, (seq, window) in enumerate(zip(seqs, windows)):
            if window is not None:
                position = torch.tensor([seq.next_position - 1], device=self.pool.device)
                window.record_all(self.queries[:, b, None], position)
