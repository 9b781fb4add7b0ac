"""Quest / LServe page selection inside the CUDA-graph decode step (see engine/graph_selection.py)."""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode, top_k
from turnkv.engine.cuda_graphs import GraphedDecode, _GraphStep
from turnkv.engine.graph_handler import MAX_WHOLE_PAGES, Handler, Plan, Upload
from turnkv.methods.lserve.decode import summaries_for
from turnkv.methods.lserve.selector import graph_page_scores


class PagedHandler(Handler):
    def __init__(self, graphs: GraphedDecode, config, num_query_heads: int):
        super().__init__(graphs)

        pool = graphs.pool
        cfg = self.config = config
        ps = pool.page_size
        self.usable = cfg.physical_page % ps == 0
        L, H, B_max = self.L, self.H, self.B_max
        self.r = max(1, cfg.physical_page // ps)  # pool pages per physical page
        self.R = num_query_heads if cfg.group == "query" else H
        self.K = cfg.pages_budget
        self.P = graphs.tables.shape[3]
        self.num_phys = -(-self.P // self.r)  # physical pages a head can hold in the graph
        dev = self.device
        self.head_of_row = torch.arange(self.R, device=dev) // (self.R // H)
        self.row_heads = np.arange(self.R) // (self.R // H)
        self.chosen = torch.zeros(L, B_max, self.R, self.K, dtype=torch.int64, device=dev)
        # Per step: whole [L, B, H] (1: the row reads its whole list), read [L, B, H] (tokens each row
        # reads), refresh [L, B] (1: the row's selection is made again in this step).
        self.upload = Upload([L * B_max * H, L * B_max * H, L * B_max], dev)
        whole, read, refresh = self.upload.views
        self.whole, self.read = whole.view(L, B_max, H), read.view(L, B_max, H)
        self.refresh = refresh.view(L, B_max)
        layer = torch.arange(L, device=dev)[:, None, None]
        batch = torch.arange(B_max, device=dev)[None, :, None]
        # First cell of each row's page table in the graph's flat tables: [L, B, R, 1].
        self.row_base = (((layer * B_max + batch) * H + self.head_of_row) * self.P)[..., None]
        self.summaries = summaries_for(pool, cfg.logical_page) if self.usable else None

    # ---- host -----------------------------------------------------------------------------------
    def plan(self, seqs, sels) -> Plan | None:
        cfg, K, L = self.config, self.K, self.L
        PP, ps = cfg.physical_page, self.graphs.pool.page_size
        moved = np.stack([sel.sync_all(seq) for sel, seq in zip(sels, seqs)])  # [B, L]; stats exact again
        recs = [self.record(sel) for sel in sels]
        for b in np.flatnonzero(moved.any(axis=1)).tolist():
            recs[b].valid[moved[b]] = False  # a selecting head's tokens moved: its selection names old pages
        lengths = np.stack([seq.lengths for seq in seqs]) + 1  # [B, L, H] once the step's token is in
        flags = [sel.streaming_flags(seq) for sel, seq in zip(sels, seqs)]
        if all(f is flags[0] for f in flags):  # one recipe's flags (read only): no copy per conversation
            streaming = np.broadcast_to(flags[0], lengths.shape)
        else:
            streaming = np.stack(flags)
        pages = -(-lengths // PP)
        sel_pages = np.where(streaming, 0, pages)  # streaming heads never select
        layer_selects = np.arange(L) >= cfg.dense_layers
        selecting = layer_selects & (sel_pages.max(axis=2) > K)  # [B, L]
        whole = streaming | ~selecting[..., None] | (pages <= K)
        read = np.where(whole, lengths, (K - 1) * PP + lengths - (pages - 1) * PP)
        if not selecting.any():
            kw, variant = 0, "dense"
            refresh = np.zeros_like(selecting)
            moves = []
        else:
            # Whole-list rows of the selecting layers read their page table through the same rows.
            pool_pages = -(-lengths // ps)  # [B, L, H]
            need = int(pool_pages[whole & layer_selects[None, :, None]].max(initial=0))
            kw = max(K, 1 << int(-(-need // self.r) - 1).bit_length())
            if kw > MAX_WHOLE_PAGES:
                return None
            valid = np.zeros_like(selecting)
            moves = []
            for b, (sel, rec) in enumerate(zip(sels, recs)):
                if self.in_buffers(sel, rec):
                    valid[b] = rec.valid
                    if rec.row != b:
                        moves.append((rec.row, b))
            stale = (sel_pages != np.stack([rec.pages for rec in recs])).any(axis=2)
            ages = np.stack([rec.age for rec in recs])
            refresh = selecting & (~valid | (ages >= cfg.reuse_interval) | stale)
            variant = "select" if refresh.any() else "reuse"

        def run(bucket: int, B: int):
            self.move_rows([self.chosen], moves)
            for b, (sel, rec) in enumerate(zip(sels, recs)):
                sel.begin(True)
                sel.state.invalidate()  # the eager selector's cache: this selection lives in the graph
                fresh = refresh[b]
                if fresh.any():
                    rec.valid[fresh], rec.age[fresh], rec.pages[fresh] = True, 0, sel_pages[b][fresh]
                    for layer in np.flatnonzero(fresh).tolist():
                        sel.state.selections[layer] += 1
                rec.age[selecting[b]] += 1
                rec.ticks, rec.row = sel.ticks, b
                self.owner[b] = sel
            host_whole, host_read, host_refresh = self.upload.host()
            host_whole = host_whole.reshape(L, -1, self.H)
            host_read = host_read.reshape(L, -1, self.H)
            host_refresh = host_refresh.reshape(L, -1)
            host_whole[:, :B], host_read[:, :B] = whole.transpose(1, 0, 2), read.transpose(1, 0, 2)
            host_whole[:, B:bucket], host_read[:, B:bucket] = 1, 0  # padding rows read nothing
            host_refresh[:, :B], host_refresh[:, B:bucket] = refresh.T, 0
            self.upload.send()
            return self.replay((bucket, variant, kw), bucket, B, lambda: _PagedStep(self.graphs, bucket, self, variant, kw))

        return Plan(run, lambda seqs: None)

    def after_eager(self, seqs, sels) -> None:
        pass  # the eager step's begin() made the records stale: the next graphed step selects again

    # ---- inside the graph -------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, batch: int, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Score layer's pages for query q [batch, Hq, D], write the refreshed rows of `chosen`, and
        return layer's expanded tables and read lengths (see expand)."""

        g, cfg = self.graphs, self.config
        lengths = g.lengths[layer, :batch]
        scores = graph_page_scores(q, self.summaries.kmax[layer], self.summaries.kmin[layer], g.tables[layer, :batch],
                                   lengths, self.num_phys, cfg, g.pool.page_size)  # [batch, R, num_phys]
        if decode.uses_kernel(self.device):  # the top-k's candidates, then one kernel: merge, commit, expand
            from turnkv.attention.triton import page_select

            candidates = top_k.top_k_candidates(scores, self.K)
            table, read = page_select.expand_pages(self.chosen, self.whole, self.read, g.tables, g.lengths, layer, 1,
                                                   batch, kw, self.r, cfg.physical_page, candidates=candidates,
                                                   refresh=self.refresh)
            return table[0], read[0]
        top = top_k.top_k_ascending(scores, min(self.K - 1, self.num_phys))
        newest = (lengths.long() + cfg.physical_page - 1) // cfg.physical_page - 1
        fresh = torch.cat([top, newest.index_select(1, self.head_of_row)[..., None]], dim=-1)
        keep = self.refresh[layer, :batch, None, None] == 0
        self.chosen[layer, :batch].copy_(torch.where(keep, self.chosen[layer, :batch], fresh))
        return self.expand(layer, batch, kw)

    def expand(self, layer, batch: int, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool-page tables [..., batch, R, kw * r] (int32) and read lengths [..., batch, R] (int32) of
        one layer (an int) or all (slice(None)): a whole-list row reads its page table, a selecting
        row the r pool pages of each chosen physical page."""
        g, r = self.graphs, self.r
        if decode.uses_kernel(self.device):
            from turnkv.attention.triton import page_select

            one = isinstance(layer, int)
            table, read = page_select.expand_pages(self.chosen, self.whole, self.read, g.tables, g.lengths,
                                                   layer if one else 0, 1 if one else self.L, batch, kw, self.r,
                                                   self.config.physical_page)
            return (table[0], read[0]) if one else (table, read)
        idx = torch.arange(kw, device=self.device)
        chosen = self.chosen[layer, :batch].index_select(-1, idx.clamp(max=self.K - 1))
        whole = self.whole[layer, :batch].index_select(-1, self.head_of_row) != 0
        phys = torch.where(whole[..., None], idx, chosen)
        cols = (phys[..., None] * r + torch.arange(r, device=self.device)).flatten(-2).clamp_(max=self.P - 1)
        table = g.tables_flat[self.row_base[layer, :batch] + cols]
        lengths = self.read[layer, :batch].index_select(-1, self.head_of_row).to(torch.int32)
        return table, lengths


class _PagedStep(_GraphStep):
    """The AttentionStep of a paged-selection graph: `variant` is "select", "reuse" or "dense"."""

    def __init__(self, runner: GraphedDecode, batch: int, handler: PagedHandler, variant: str, kw: int):
        super().__init__(runner, batch)
        self.handler, self.variant, self.kw = handler, variant, kw
        self.dense_layers = handler.config.dense_layers if variant != "dense" else runner.pool.num_layers
        Hq, D = runner.queries.shape[2], runner.queries.shape[3]
        width = max(1, kw * handler.r) * runner.pool.page_size
        self.sel_splits = decode.num_splits(runner.pool.device, batch * handler.R, width, runner.pool.kv_dtype,
                                            selected=True)
        self.sel_workspace = (torch.empty(batch * Hq * self.sel_splits * D, device=runner.pool.device),
                              torch.empty(batch * Hq * self.sel_splits, device=runner.pool.device))
        self.expanded = None

    def prepare(self) -> None:
        if self.variant == "reuse":
            self.expanded = self.handler.expand(slice(None), self.batch, self.kw)

    def attention(self, layer, q, k, v):  # rotate() has stored K/V and q
        B, _, Hq, D = q.shape
        if self.pool.quantized:  # the statistics stay those of the compute-dtype keys, not of the codes
            self.handler.summaries.update(layer, self.slots[layer], k.transpose(1, 2).reshape(-1, D))
        elif layer == self.pool.num_layers - 1:  # every layer's key is in the pool now
            self.handler.summaries.fold(self.slots)
        common = dict(window=self.window, key_positions=self.pool.positions[layer], query_positions=self.positions)
        if layer < self.dense_layers:
            out = decode.indexed_decode(q[:, 0], self.pool.k[layer], self.pool.v[layer], self.tables[layer],
                                        self.lengths[layer], self.splits, workspace=self.workspace, **common,
                                        **self.pool.scale_kwargs(layer))
            return out[:, None]
        if self.variant == "select":
            table, lengths = self.handler.select(layer, q[:, 0], self.batch, self.kw)
        else:
            table, lengths = self.expanded[0][layer], self.expanded[1][layer]
        out = decode.indexed_decode(q[:, 0], self.pool.k[layer], self.pool.v[layer], table, lengths, self.sel_splits,
                                    workspace=self.sel_workspace, **common, **self.pool.scale_kwargs(layer))
        return out[:, None]


# ---- LoopServe ------------------------------------------------------------------------------------
