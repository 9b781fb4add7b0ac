"""Short prefill chunks replayed from CUDA graphs: a later turn of a few hundred tokens spends most of
its time issuing the layers' launches, which one graph replay issues at once.

One graph per bucket of ROW_BUCKETS rows, captured on first use, the chunk's T new tokens last (left
padding). The attention is causal from the bottom right: row t sees entries j <= length - rows + t,
so a real token sees exactly what it would in a chunk of its own, and a padding row sees less (nothing
on a fresh sequence; the paged kernel gives it zeros). Padding rows write their K/V into the trash page
GraphedDecode holds, never into a table. Where FlashAttention-4 takes a bucket's rows over the history
(attention/flash.py takes_chunk, for the rows the graph runs; its histories are long, so every padding
row sees some), the bucket has a second graph that reads the pages through FA4.

Per chunk the host makes one asynchronous upload from pinned memory (token ids, positions, slots,
lengths), plus a device-to-device copy of the sequence's page table into the graphs' own. Every layer
keeps its last WINDOW_ROWS queries in a static buffer, which an eviction recipe's observation window
(a plain QueryWindow of at most WINDOW_ROWS queries, without moments) takes after the replay. Chunks
with other recipe hooks (prefill pattern, decode selection, accumulation) or that want every token's
logits stay eager. Design: docs/architecture.md#cuda-graphs

Switch: TURNKV_PREFILL_GRAPHS=0 in the environment (read at import) or `graph_prefill.ENABLED = False`
runs every prefill chunk eagerly; LLM(cuda_graphs=False) turns these and the decode graphs off."""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from turnkv.attention import chunk, flash
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.step_context import StepContext
from turnkv.methods.window import QueryWindow

ENABLED = os.environ.get("TURNKV_PREFILL_GRAPHS", "1") != "0"
ROW_BUCKETS = (16, 32, 64, 128, 256, 512)
WINDOW_ROWS = 64  # queries per layer kept for an observation window (SnapKV's 32, kvpress's 64)


def replayable(context: StepContext | None) -> bool:
    """Whether a recipe's context asks nothing of a prefill step that a graph cannot do: the full
    cache's asks nothing; an eviction scorer's window of the last queries is filled after the replay."""
    if context is None:
        return True
    window = context.window
    return (context.pattern is None and context.selector is None and not context.accumulate
            and (window is None or (type(window) is QueryWindow and window.size <= WINDOW_ROWS
                                    and window.moments is None)))


class _PrefillStep:
    """The decoder's AttentionStep over one bucket's static buffers: store K/V and the last queries,
    then attend over the sequence's table (the chunk's own entries included) with the paged chunk
    kernel, or with FA4 (flash_attention)."""

    def __init__(self, owner: GraphedPrefill, rows: int, splits: int, flash_attention: bool = False):
        L, H = owner.pool.num_layers, owner.pool.num_kv_heads
        self.pool, self.splits, self.window = owner.pool, splits, owner.sliding_window
        self.flash = flash_attention
        self.slots = owner.slots[: L * H * rows].view(L, H * rows)
        self.positions = owner.positions[:rows].view(1, rows)
        self.tables, self.lengths = owner.tables, owner.lengths
        self.kept = min(rows, WINDOW_ROWS)
        self.queries = owner.queries[:, WINDOW_ROWS - self.kept :]

    def attention(self, layer, q, k, v):
        self.pool.write_heads(layer, self.slots[layer], k, v)
        self.queries[layer].copy_(q[0, -self.kept :])
        if self.flash:
            return flash.paged(q.transpose(1, 2), self.pool.k[layer], self.pool.v[layer], self.tables[layer],
                               self.lengths[layer]).transpose(1, 2)
        out = chunk.paged_chunk(q.transpose(1, 2), self.pool.k[layer], self.pool.v[layer], self.tables[layer],
                                self.lengths[layer], self.splits, window=self.window,
                                key_positions=self.pool.positions[layer], query_positions=self.positions,
                                **self.pool.scale_kwargs(layer))
        return out.transpose(1, 2)


class GraphedPrefill:
    """Beside a GraphedDecode, whose trash page, capacity and graph memory pool it shares."""

    def __init__(self, decode_graphs: GraphedDecode):
        g = decode_graphs
        self.graphs, self.model, self.pool = g, g.model, g.pool
        self.sliding_window = g.sliding_window
        self.capacity = g.capacity
        L, H, pool = self.pool.num_layers, self.pool.num_kv_heads, self.pool
        R, P, dev = ROW_BUCKETS[-1], g.tables.shape[3], pool.device
        self.tables = torch.zeros(L, 1, H, P, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(L, 1, H, dtype=torch.int32, device=dev)
        # The per-chunk upload: token ids [R], positions [R], slots [L, H, rows] (a bucket uses the
        # first L * H * rows), lengths [L, H].
        self.sizes = [R, R, L * H * R, L * H]
        self.meta = torch.zeros(sum(self.sizes), dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slots, self.lengths64 = self.meta.split(self.sizes)
        pinned = dev.type == "cuda"
        self.staging = [torch.zeros(sum(self.sizes), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.uploaded = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.turn = 0
        self.layer_base = torch.arange(L, device=dev)[:, None] * pool.positions[0].numel()
        self.last_row = {rows: torch.full((1, 1), rows - 1, device=dev) for rows in ROW_BUCKETS}
        # Post-RoPE queries of each layer's last WINDOW_ROWS rows (the bucket's last rows, right-aligned).
        Hq, D = g.model.config.num_heads, pool.head_dim
        self.queries = torch.zeros(L, WINDOW_ROWS, Hq, D, dtype=pool.dtype, device=dev)
        # (rows, through FA4) -> (graph, its logits)
        self.graphs_by_key: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.flash_ok = True  # False once FA4 failed to be captured

    def takes(self, seq: SequenceKV, num_new: int, context: StepContext | None) -> bool:
        """Whether a chunk of num_new tokens appended to seq runs here rather than in an eager step."""
        pool = self.pool
        if not (ENABLED and 0 < num_new <= ROW_BUCKETS[-1] and replayable(context)):
            return False
        if pool.device.type == "cuda" and not chunk.uses_kernel(pool.device):
            return False  # the reference path reads lengths on the host: not in a graph
        return seq.next_position + num_new <= self.capacity

    def uses_flash(self, rows: int, longest: int) -> bool:
        """Whether a bucket of `rows` over heads of at most `longest` entries attends through FA4: it is
        installed, the pool holds the compute dtype, no sliding window, and the rows have work enough."""
        pool = self.pool
        group = self.model.config.num_heads // pool.num_kv_heads
        return (self.flash_ok and self.sliding_window is None and not pool.quantized
                and flash.usable(pool.device, pool.dtype, pool.head_dim)
                and flash.takes_chunk(pool.device, pool.num_kv_heads, group, rows, longest))

    @torch.inference_mode()
    def prefill(self, seq: SequenceKV, token_ids: list[int], context: StepContext | None = None) -> torch.Tensor:
        """Append token_ids to seq (takes() said yes) -> fp32 logits [V] at the last one (a copy), and
        hand context's observation window the chunk's last queries. All or nothing: on an error seq is
        as it was and the window has recorded nothing."""
        before = seq.next_position
        slots = seq.reserve_on_host(len(token_ids))  # [L, H, T]; raises with nothing reserved
        try:
            logits = self._run_chunk(seq, token_ids, slots, before)
        except BaseException:
            seq.truncate(before)
            raise
        window = None if context is None else context.window
        if window is not None:
            T = len(token_ids)
            n = min(T, window.size)
            window.record_all(self.queries[:, WINDOW_ROWS - n :], torch.arange(before + T - n, before + T))
        return logits

    def _run_chunk(self, seq, token_ids, slots, before):
        L, H, T = slots.shape
        rows = next(r for r in ROW_BUCKETS if r >= T)
        pad = rows - T
        k = self.turn % 2
        self.turn += 1
        if self.uploaded is not None:
            self.uploaded[k].synchronize()  # the copy that last read this staging buffer is done
        ids, positions, all_slots, lengths = np.split(self.staging[k].numpy(), np.cumsum(self.sizes)[:-1])
        ids[:pad], ids[pad:rows] = 0, token_ids
        positions[:pad], positions[pad:rows] = before, np.arange(before, before + T)
        bucket_slots = all_slots[: L * H * rows].reshape(L, H, rows)
        bucket_slots[:, :, :pad] = self.graphs.trash_pages[:, None, None] * self.pool.page_size
        bucket_slots[:, :, pad:] = slots
        lengths[:] = seq.lengths.reshape(-1)
        self.meta.copy_(self.staging[k], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded[k].record()
        width = min(int(seq.num_pages.max(initial=0)), self.tables.shape[3])
        self.tables[:, 0, :, :width].copy_(seq.device_table()[:, :, :width])
        key = (rows, self.uses_flash(rows, int(seq.lengths.max())))
        if self.pool.device.type != "cuda":  # the same steps without a graph: how CPU tests check them
            return self._run(rows, _PrefillStep(self, rows, self.splits(rows), key[1]))[0, 0].clone()
        if key not in self.graphs_by_key:
            self.graphs_by_key[key] = self._capture(*key)
        graph, logits = self.graphs_by_key[key]
        graph.replay()
        return logits[0, 0].clone()

    def _capture(self, rows: int, flash_attention: bool):
        step = _PrefillStep(self, rows, self.splits(rows), flash_attention)
        try:
            return self.graphs.capture(lambda: self._run(rows, step))
        except Exception as error:  # noqa: BLE001 - an optional package that cannot be captured
            if not flash_attention:
                raise
            self.flash_ok = False
            warnings.warn(f"FlashAttention-4 could not be captured in a CUDA graph; short prefill chunks use the "
                          f"paged kernel: {error!r}", stacklevel=3)
            step = _PrefillStep(self, rows, self.splits(rows))
            return self.graphs.capture(lambda: self._run(rows, step))

    def splits(self, rows: int) -> int:
        """The key splits of a bucket's graph: as the eager step would choose them for the longest
        history, the context limit. A shorter history spreads over as many splits in shorter pieces
        (splits past its keys are empty), which keeps the SMs as busy."""
        group = self.model.config.num_heads // self.pool.num_kv_heads
        return chunk.num_splits(self.pool.device, self.pool.num_kv_heads, rows, group, self.capacity, self.pool.dtype)

    def _run(self, rows: int, step: _PrefillStep) -> torch.Tensor:
        """Inside the graph: put the uploaded metadata in place, then the decoder over the bucket."""
        L, H = self.pool.num_layers, self.pool.num_kv_heads
        self.lengths.view(-1).copy_(self.lengths64)
        flat = (step.slots + self.layer_base).reshape(-1)
        positions = step.positions.view(1, rows).expand(L * H, rows).reshape(-1)
        self.pool.positions.view(-1).index_copy_(0, flat, positions)
        self.pool.attention_mass.view(-1).index_fill_(0, flat, 0.0)
        ids = self.input_ids[:rows].view(1, rows)
        return self.model(ids, step.positions, step, logits_at=self.last_row[rows])
