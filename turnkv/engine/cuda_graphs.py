"""Decode steps replayed from CUDA graphs, one per batch-size bucket (as nano-vllm does).

Everything that changes between steps lives in static buffers the graph reads; one graph serves any
lengths up to its capacity. Per step the host makes one asynchronous upload from pinned memory (new
slots, lengths, positions, changed page-table cells; the graph scatters them), plus a second one for
tables that SequenceKV.drop_pages shifted (`table_changes`). Rows beyond the live batch get length 0
and write their K/V into a page set aside for them. Nothing in a step waits for the GPU.
Design: docs/architecture.md#cuda-graphs"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from turnkv.attention import decode
from turnkv.capture_lock import CAPTURE_LOCK
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV, reserve_step_on_host
from turnkv.model import ops
from turnkv.model.decoder import Transformer
from turnkv.model.parallel import collectives_skipped

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def table_changes(seq: SequenceKV, uploaded_pages: np.ndarray, uploaded_edits: np.ndarray):
    """What a copy of seq's page table needs to be current, given the head page counts [L, H] and the
    SequenceKV.table_edits [L, H] it was made at (it holds every column below uploaded_pages, and no
    page was released behind it: seq.shrinks unchanged). Returns None when it must be copied whole (a
    head that drop_pages did not edit grew by more than one page: a prefill), else (appended,
    rewritten): appended = (layer, head, column) arrays, one new column per head that grew (decode
    adds at most one page per head and step); rewritten = (layer, head, lo, hi) arrays, column
    ranges [lo, hi) to copy again in heads that drop_pages edited (their table shifted left: every
    column from the first one it rewrote, or from the first one the copy lacks, to the head's end)."""
    edited = seq.table_edits != uploaded_edits
    if ((seq.num_pages - uploaded_pages > 1) & ~edited).any():
        return None
    layer, head = np.nonzero((seq.num_pages > uploaded_pages) & ~edited)
    e_layer, e_head = np.nonzero(edited)
    lo = np.minimum(uploaded_pages[e_layer, e_head], seq.edited_from[e_layer, e_head])
    hi = np.maximum(seq.num_pages[e_layer, e_head], lo)
    return (layer, head, uploaded_pages[layer, head]), (e_layer, e_head, lo, hi)


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
        self.splits = decode.num_splits(r.pool.device, batch * H, r.capacity, r.pool.kv_dtype)
        Hq, D = r.queries.shape[2], r.queries.shape[3]
        self.workspace = (torch.empty(batch * Hq * self.splits * D, device=r.pool.device),
                          torch.empty(batch * Hq * self.splits, device=r.pool.device))

    def rotate(self, layer, qkv, num_heads, cos, sin):
        """RoPE, then this step's stores: K/V into the pool and q into `queries` (kept for the methods'
        observation windows). One kernel on CUDA for an unquantized pool (ops.rotate_and_store): two
        launches less per layer than the rotation, the pool's write and the copy."""
        Hq = self.queries.shape[2]
        if not self.pool.quantized and ops.rotate_and_store(qkv, Hq, cos, sin, self.queries[layer], self.slots[layer],
                                                            self.pool.k[layer], self.pool.v[layer]):
            return qkv[:, :, :num_heads]
        rotated = ops.rotate_heads(qkv, num_heads, cos, sin)
        self.pool.write_heads(layer, self.slots[layer], rotated[:, :, Hq:], qkv[:, :, num_heads:])
        self.queries[layer].copy_(rotated[:, 0, :Hq])
        return rotated

    def attention(self, layer, q, k, v):
        # rotate() has stored K/V and q.
        out = decode.indexed_decode(q[:, 0], self.pool.k[layer], self.pool.v[layer], self.tables[layer],
                                    self.lengths[layer], self.splits, window=self.window,
                                    key_positions=self.pool.positions[layer], query_positions=self.positions,
                                    workspace=self.workspace, **self.pool.scale_kwargs(layer))
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
        # (seq, shrinks, pages uploaded [L, H], table_edits uploaded [L, H]) per row
        self.rows: list[tuple[SequenceKV, int, np.ndarray, np.ndarray] | None] = [None] * B
        # Table cells to rewrite before the step (heads drop_pages shifted): (flat cells, page ids), and
        # per staging turn a pinned buffer they cross from, grown on demand.
        self.rewrites: tuple[np.ndarray, np.ndarray] | None = None
        self.rewrite_staging: list[torch.Tensor | None] = [None, None]
        self.layer_base = torch.arange(L, device=dev)[:, None] * pool.positions[0].numel()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, _GraphStep]] = {}
        self.memory_pool = None
        # A decode selection's graphs (engine/graph_selection.py): `selection` keeps them; `variant`,
        # set by the runner around one step, replays one of them in place of the plain graph.
        self.selection = None
        self.variant = None

    def close(self) -> None:
        for layer, page in enumerate(self.trash_pages):
            self.pool.release(layer, [int(page)])
        self.graphs.clear()
        if self.selection is not None:
            self.selection.close()

    def fits(self, seqs: list[SequenceKV]) -> bool:
        return len(seqs) <= self.buckets[-1] and max(s.next_position for s in seqs) < self.capacity

    @torch.inference_mode()
    def step(self, seqs: list[SequenceKV], token_ids: torch.Tensor) -> torch.Tensor:
        """Reserve one token in each sequence and run the decode step: token_ids [B] (on the device)
        -> fp32 logits [B, V] (a view of the graph's output: use it before the next step). On an
        error nothing is reserved."""
        bucket = next(b for b in self.buckets if b >= len(seqs))
        # All or nothing, one PagePool.room for the step: the same outcome on every tensor-parallel rank.
        reserved = list(reserve_step_on_host(seqs)[..., 0])  # B x [L, H]
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
        self._upload_rewrites(k)
        if self.uploaded is not None:
            self.uploaded[k].record()
        self.input_ids[:B, 0].copy_(token_ids.view(B))
        self.input_ids[B:bucket].zero_()
        if self.variant is not None:  # a selection's graph (engine/graph_selection.py), after the same upload
            return self.variant(bucket, B)
        if self.pool.device.type != "cuda":  # the same steps without a graph: how CPU tests check them
            return self._run(bucket, _GraphStep(self, bucket))[:B, 0]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits, _ = self.graphs[bucket]
        graph.replay()
        return logits[:B, 0]

    def _table_updates(self, seqs, cells, pages) -> int:
        """Fill (cell, page) pairs for the table columns each row gained since the last step, and put in
        self.rewrites the cells of heads whose table drop_pages shifted (`_upload_rewrites` sends them).
        A row that changed sequence, whose sequence released pages (keep, truncate) or grew by more
        than a page in some head (a prefill) gets its whole table copied right away, from the
        sequence's device table."""
        H, P = self.pool.num_kv_heads, self.tables.shape[3]
        B_max = self.tables.shape[1]
        n = 0
        rewrite_cells, rewrite_pages = [], []
        for b, seq in enumerate(seqs):
            row = self.rows[b]
            changes = None
            if row is not None and row[0] is seq and row[1] == seq.shrinks:
                changes = table_changes(seq, row[2], row[3])
            if changes is None:
                width = min(int(seq.num_pages.max(initial=0)), P)
                self.tables[:, b, :, :width].copy_(seq.device_table()[:, :, :width])  # device to device
                self.rows[b] = (seq, seq.shrinks, seq.num_pages.copy(), seq.table_edits.copy())
                continue
            (layer, head, col), (e_layer, e_head, lo, hi) = changes
            count = len(layer)
            if count:
                cells[n : n + count] = ((layer * B_max + b) * H + head) * P + col
                pages[n : n + count] = seq.table[layer, head, col]
                n += count
                row[2][layer, head] += 1
            if len(e_layer):
                owner = np.repeat(np.arange(len(lo)), hi - lo)
                col = lo[owner] + np.arange(owner.size) - np.repeat(np.cumsum(hi - lo) - (hi - lo), hi - lo)
                layer, head = e_layer[owner], e_head[owner]
                rewrite_cells.append(((layer * B_max + b) * H + head) * P + col)
                rewrite_pages.append(seq.table[layer, head, col])
                row[2][e_layer, e_head] = seq.num_pages[e_layer, e_head]
                row[3][:] = seq.table_edits
        self.rewrites = (np.concatenate(rewrite_cells), np.concatenate(rewrite_pages)) if rewrite_cells else None
        return n

    def _upload_rewrites(self, k: int) -> None:
        """Scatter self.rewrites into the tables before the step runs: one asynchronous copy from this
        turn's pinned buffer (the event recorded after it guards the buffer, as the metadata's) and
        one index_copy_ on the step's stream, outside the graph. Nothing waits for the GPU."""
        if self.rewrites is None:
            return
        cells, pages = self.rewrites
        m = len(cells)
        buf = self.rewrite_staging[k]
        if buf is None or buf.numel() < 2 * m:
            size = 1 << max(12, (2 * m - 1).bit_length())
            buf = self.rewrite_staging[k] = torch.zeros(size, dtype=torch.int64, pin_memory=self.uploaded is not None)
        host = buf.numpy()
        host[:m], host[m : 2 * m] = cells, pages
        sent = buf[: 2 * m].to(self.pool.device, non_blocking=True)
        self.tables_flat.index_copy_(0, sent[:m], sent[m:].to(torch.int32))
        self.rewrites = None

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
        graph, logits = self.capture(lambda: self._run(batch, step))
        return graph, logits, step

    def capture(self, run):
        """A CUDA graph of run() -> (graph, its output), in the memory pool every graph of this runner
        shares (the selection variants of engine/graph_selection.py too). Warm up outside the graph
        first: Triton compiles its kernels on the first call; the warm-up's writes are the replay's.
        Under CAPTURE_LOCK: no other thread issues device work meanwhile (a background pack waits).
        A tensor-parallel shard (model.shard): the warm-up runs no collectives (every rank must run the same
        ones, and another rank may replay where this one captures); the capture records the all-reduces
        and the LM head's all-gather, and is made in thread-local mode, so that the process group's
        watchdog thread, which queries its events while this thread captures, does not void the capture
        (CAPTURE_LOCK keeps the engine's own threads out)."""
        sharded = getattr(self.model, "shard", None) is not None
        with CAPTURE_LOCK:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), (collectives_skipped() if sharded else nullcontext()):
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            mode = "thread_local" if sharded else "global"
            with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode=mode):
                out = run()
        return graph, out

    def record_windows(self, seqs: list[SequenceKV], windows: list) -> None:
        """Hand the step's queries to the observation windows of the conversations that keep one."""
        for b, (seq, window) in enumerate(zip(seqs, windows)):
            if window is not None:
                # The position stays on the host until the window files its pending steps: a
                # pageable upload here would wait for the step in flight (decode runs one ahead).
                window.record_all(self.queries[:, b, None], torch.tensor([seq.next_position - 1]))
