"""LoopServe's progressive decode selection inside the CUDA-graph decode step (see
engine/graph_selection.py)."""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode, top_k
from turnkv.engine.cuda_graphs import GraphedDecode, _GraphStep
from turnkv.engine.graph_handler import Handler, Plan, Upload
from turnkv.methods.loopserve.decode import _Picked, window_scores

RESCORE_IN_GRAPH = True  # False: LoopServe's re-selection steps run eagerly (the slower fallback)


class ProgressiveHandler(Handler):
    def __init__(self, graphs: GraphedDecode, config, num_query_heads: int):
        super().__init__(graphs)
        self.config = config
        L, H, B_max = self.L, self.H, self.B_max
        pool = graphs.pool
        self.R = num_query_heads if config.granularity == "query" else H
        self.G = self.R // H
        self.W = -(-(config.budget + config.interval) // 16) * 16  # selected tokens + those since
        self.capacity = graphs.tables.shape[3] * pool.page_size
        self.budget = min(config.budget, self.capacity)
        dev = self.device
        self.head_of_row = torch.arange(self.R, device=dev) // self.G
        self.table_flat = torch.zeros(L * B_max * self.R * self.W + 1, dtype=torch.int32, device=dev)  # + trash
        self.table = self.table_flat[:-1].view(L, B_max, self.R, self.W)
        # Per step: read [L, B, H] (tokens each row reads), refresh [L, B] (1: the row's selection is
        # made again in this step, inside the graph).
        self.upload = Upload([L * B_max * H, L * B_max], dev)
        self.read = self.upload.views[0].view(L, B_max, H)
        self.refresh = self.upload.views[1].view(L, B_max)
        layer = torch.arange(L, device=dev)[:, None, None]
        batch = torch.arange(B_max, device=dev)[None, :, None]
        self.row_base = ((layer * B_max + batch) * self.R + torch.arange(self.R, device=dev)) * self.W  # [L, B, R]
        # The observation window of a re-selection: the conversation's last n - 1 queries (copied in
        # before the step) and the step's own (written by the graph at each layer) in the last slot.
        self.Wn = config.observation
        Hq, D = graphs.queries.shape[2], graphs.queries.shape[3]
        self.window_shape = (L, B_max, self.Wn, Hq, D)
        self.window = self.window_pos = None  # made on the first re-selection in a graph

    def plan(self, seqs, sels) -> Plan | None:
        cfg, L, G = self.config, self.L, self.G
        steps = [sel.steps + 1 for sel in sels]
        warm = [n < cfg.warmup for n in steps]
        g = self.graphs
        if all(warm):  # warm-up reads everything: the plain graph
            def after(seqs):
                for b, sel in enumerate(sels):
                    sel.begin(True)
                    sel.record_step(g.queries[:, b], g.positions[b : b + 1])
            return Plan(None, after)
        if any(warm):
            return None  # warm-up rows read everything: not beside selecting rows in one graph
        in_graph = RESCORE_IN_GRAPH
        recs = [self.record(sel) for sel in sels]
        moves = []
        B = len(seqs)
        lengths = np.stack([seq.lengths for seq in seqs]) + 1  # [B, L, H] once the step's token is in
        refresh = np.zeros((B, L), dtype=bool)
        read = np.zeros((B, L, self.H), dtype=np.int64)
        for b, (sel, rec, n) in enumerate(zip(sels, recs, steps)):
            refresh[b] = sel.reselects_at(n) or not (self.in_buffers(sel, rec) and rec.version == sel.version)
            for layer in range(L):
                if not refresh[b, layer] and sel.stale(layer, lengths[b, layer], n):
                    refresh[b, layer] = True  # tokens moved (an eviction): this layer selects again
                if not refresh[b, layer]:
                    picked = sel.picked[layer]
                    read[b, layer] = picked.counts[::G] + lengths[b, layer] - picked.recent_from[::G]
            if not refresh[b].all() and rec.row != b:
                moves.append((rec.row, b))
        if refresh.any() and not in_graph:
            return None  # re-selections run eagerly
        history = lengths - 1
        read = np.where(refresh[..., None], np.minimum(history, self.budget) + 1, read)
        if read.max(initial=0) > self.W:
            return None
        variant = "rescore" if refresh.any() else "progressive"
        if variant == "rescore" and self.window is None:
            self.window = torch.zeros(self.window_shape, dtype=g.pool.dtype, device=self.device)
            self.window_pos = torch.full(self.window_shape[1:3], -1, dtype=torch.int64, device=self.device)

        def run(bucket: int, B: int):
            self.move_rows([self.table], moves)
            for b, (sel, seq, rec) in enumerate(zip(sels, seqs, recs)):
                sel.begin(True)
                if refresh[b].any():
                    self._window_in(b, sel)
                for layer in np.flatnonzero(refresh[b]):
                    recent_from = np.repeat(history[b, layer], G)
                    sel.picked[layer] = _picked(None, np.minimum(recent_from, self.budget), recent_from, sel.steps)
                    sel.version += 1
                    if layer == 0:
                        sel.selections += 1
                rec.ticks, rec.row, rec.version = sel.ticks, b, sel.version
                self.owner[b] = sel
            host_read, host_refresh = self.upload.host()
            host_read = host_read.reshape(L, -1, self.H)
            host_refresh = host_refresh.reshape(L, -1)
            host_read[:, :B], host_read[:, B:bucket] = read.transpose(1, 0, 2), 0
            host_refresh[:, :B], host_refresh[:, B:bucket] = refresh.T, 0
            self.upload.send()
            return self.replay((bucket, variant), bucket, B, lambda: _ProgressiveStep(g, bucket, self, variant))

        def after(seqs):
            for b, sel in enumerate(sels):
                sel.record_step(g.queries[:, b], g.positions[b : b + 1])

        return Plan(run, after)

    def _window_in(self, b: int, sel) -> None:
        """Copy the conversation's last Wn - 1 queries (every layer) into row b of the window buffer;
        the graph adds the step's own. Empty slots get position -1."""
        n = self.Wn - 1
        queries, positions = sel.queries, sel.positions  # per layer [<= Wn, Hq, D], [<= Wn]
        have = 0 if queries[0] is None else min(n, queries[0].shape[0])
        self.window_pos[b, : n - have] = -1
        if have:
            self.window[:, b, n - have : n] = torch.stack([q[-have:] for q in queries])
            self.window_pos[b, n - have : n] = positions[0][-have:]

    def after_eager(self, seqs, sels) -> None:
        """Copy each conversation's selection and the tokens since into its buffer row."""
        ps = self.graphs.pool.page_size
        for b, (seq, sel) in enumerate(zip(seqs, sels)):
            rec = self.record(sel)
            rec.row = None  # until written below
            if sel.steps < self.config.warmup or any(p is None or p.entries is None for p in sel.picked):
                continue
            rows = [sel.read_rows(layer, seq.lengths[layer]) for layer in range(self.L)]
            width = max(int(counts.max()) for _, counts in rows)
            if width > self.W:
                continue
            table = seq.device_table()  # [L, H, P]
            for layer, (entries, _) in enumerate(rows):
                page_table = table[layer].index_select(0, self.head_of_row)  # [R, P]
                pages = page_table.gather(1, (entries // ps).clamp_max(page_table.shape[1] - 1))
                self.table[layer, b, :, : entries.shape[1]] = (pages * ps + entries % ps).to(torch.int32)
            rec.row, rec.ticks, rec.version = b, sel.ticks, sel.version
            self.owner[b] = sel

    # ---- inside the graph -------------------------------------------------------------------------
    def rescore(self, layer: int, q: torch.Tensor, batch: int) -> None:
        """Alg. 6 line 5 for the rows whose refresh flag is set: the window's summed attention over
        every history key, the top `budget` ascending as pool slots into the row's first columns."""

        g, cfg, pool = self.graphs, self.config, self.graphs.pool
        ps = pool.page_size
        self.window[layer, :batch, self.Wn - 1].copy_(q)
        lengths = g.lengths[layer, :batch]
        args = (self.window[layer, :batch], self.window_pos[:batch], pool.k[layer], pool.positions[layer],
                g.tables[layer, :batch], lengths, self.capacity)
        k_scale = pool.k_scale[layer] if pool.quantized else None
        if decode.uses_kernel(self.device):
            from turnkv.attention.triton import window_scores as kernel

            scores = kernel.window_scores(*args, per_kv=cfg.granularity == "kv", sinks=cfg.sinks, k_scale=k_scale)
        else:
            scores = window_scores(*args, per_kv=cfg.granularity == "kv", sinks=cfg.sinks,
                                   k_scale=k_scale)  # [batch, R, capacity]
        top = top_k.top_k_ascending(scores, self.budget)
        args = (top, lengths, g.tables[layer, :batch], self.refresh[layer, :batch], self.table[layer, :batch],
                self.capacity, ps)
        if decode.uses_kernel(self.device):
            from turnkv.attention.triton import token_slots

            token_slots.commit_slots(*args)
        else:
            commit_slots_reference(*args)

    def append(self, layers, batch: int, slots: torch.Tensor) -> torch.Tensor:
        """Put each row's new token (slots [n, batch, H], n layers) after what the row reads; -> the
        rows' read lengths [n, batch, R] (int32)."""
        read = self.read[layers, :batch].index_select(-1, self.head_of_row)  # [n, batch, R]
        cells = torch.where(read > 0, self.row_base[layers, :batch] + read - 1, self.table_flat.numel() - 1)
        self.table_flat.index_copy_(0, cells.reshape(-1), slots.index_select(-1, self.head_of_row).reshape(-1).to(torch.int32))
        return read.to(torch.int32)


def commit_slots_reference(top, lengths, tables, refresh, out, capacity: int, page_size: int) -> None:
    """The refreshed rows' chosen tokens as pool slots (attention/triton/token_slots.py in torch): top
    [B, R, K] ascending indices, lengths [B, H], tables [B, H, P], refresh [B], out [B, R, >= K]."""
    B, R, K = top.shape
    H, P = tables.shape[1], tables.shape[2]
    head = torch.arange(R, device=top.device) // (R // H)
    history = (lengths.long() - 1).index_select(1, head)[..., None]
    top = torch.where(top < history, top, capacity)  # padding (picked last, ascending) past the valid ones
    pages = tables.long().index_select(1, head).gather(2, (top // page_size).clamp(max=P - 1))
    slots = (pages * page_size + top % page_size).to(torch.int32)
    old = out[:, :, :K]
    old.copy_(torch.where(refresh[:, None, None] != 0, slots, old))


def _picked(entries, counts, recent_from, step):

    return _Picked(entries, counts, recent_from, step)


class _ProgressiveStep(_GraphStep):
    """The AttentionStep of a progressive-selection graph: every layer reads its rows' slot lists;
    variant "rescore" first makes the refreshed rows' selection again, layer by layer."""

    def __init__(self, runner: GraphedDecode, batch: int, handler: ProgressiveHandler, variant: str):
        super().__init__(runner, batch)
        self.handler, self.variant = handler, variant
        Hq, D = runner.queries.shape[2], runner.queries.shape[3]
        self.sel_splits = decode.num_splits(runner.pool.device, batch * handler.R, handler.W, runner.pool.kv_dtype,
                                            selected=True)
        self.sel_workspace = (torch.empty(batch * Hq * self.sel_splits * D, device=runner.pool.device),
                              torch.empty(batch * Hq * self.sel_splits, device=runner.pool.device))
        self.read_rows = None

    def new_slots(self, layers):
        L, H = self.pool.num_layers, self.pool.num_kv_heads
        return self.slots.reshape(L, self.batch, H)[layers]

    def prepare(self) -> None:
        if self.variant == "progressive":  # every layer's new token at once
            self.read_rows = self.handler.append(slice(None), self.batch, self.new_slots(slice(None)))
        else:
            self.handler.window_pos[: self.batch, self.handler.Wn - 1].copy_(self.positions)

    def attention(self, layer, q, k, v):  # rotate() has stored K/V and q
        B, _, Hq, D = q.shape
        if self.variant == "rescore":
            self.handler.rescore(layer, q[:, 0], self.batch)
            read = self.handler.append(layer, self.batch, self.new_slots(layer))
        else:
            read = self.read_rows[layer]
        out = decode.indexed_decode(
            q[:, 0], self.pool.k[layer].view(-1, 1, D), self.pool.v[layer].view(-1, 1, D),
            self.handler.table[layer, : self.batch], read, self.sel_splits, window=self.window,
            key_positions=self.pool.positions[layer].view(-1, 1), query_positions=self.positions,
            workspace=self.sel_workspace, **self.pool.scale_kwargs(layer, slots=True))
        return out[:, None]
