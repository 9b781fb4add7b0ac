"""Decode selection inside the CUDA-graph decode step: Quest / LServe page selection and LoopServe's
progressive decode, replayed from graphs instead of run eagerly with per-layer host work.

The graphs of engine/cuda_graphs.py read everything from static buffers; a selection adds its own:

Quest / LServe (`_PagedHandler`, one per selector config). Per layer and batch row, `chosen`
[L, B, R, K] holds the K = pages_budget physical pages each row reads (R = query heads for
group="query", else KV heads), the K - 1 best ascending and the newest last, as the eager selector
orders them. Three graph variants per bucket:
- "select": each layer scores its pages inside the graph (selector.graph_page_scores: the Triton
  kernel reads the key min/max through the page table and skips pages past each head's live length),
  takes the top K - 1 of a capacity-padded score row (-inf padding: at 128K, 2K physical pages of 64
  or 8K of 16 per row, a few hundred KB per layer), appends the newest page and writes the rows that
  refresh into `chosen`;
- "reuse": `chosen` as it is (expanded for every layer at once before the first layer);
- "dense": no selection (every selecting head within budget): the plain paged tables.
All three expand `chosen` through the graph's page tables into pool-page tables [B, R, Kw * r]
(r = physical_page // pool page size; page-granular, so the indexed decode kernel walks whole pool
pages) and fold the step's keys into the page statistics at the end of the step (one kernel for all
layers: no selection reads a page from the newest on, so the newest key can wait until then).
The host decides per step and conversation what the eager selector would: a layer selects when one
of its selecting heads holds more than K pages; it refreshes when its selection is `reuse` steps
old, when a selecting head's page count changed (a new page opened: the forced newest page must be
the current one) or when the selection is not in the buffers (first step, an eager step ran, the
conversation's tokens moved). Per-conversation timers under batching: the upload carries a refresh
flag per (layer, row); the "select" variant runs when any row refreshes, and rows that do not
refresh keep their selection (torch.where on `chosen`). Rows that read their whole list (streaming
heads, heads within budget, layers with no head over budget) expand to their page table.

LoopServe (`_ProgressiveHandler`). `table` [L, B, R, W] holds per row the pool slots it reads: the
selected history tokens (ascending), then the tokens since the selection; W = budget + n_d rounded.
Two variants per bucket: "progressive" appends the step's token to every row (all layers at once,
before the first) and reads the rows; "rescore", on a re-selection step (n_o = warm-up, then every
n_d), makes the refreshed rows' selection again at each layer inside the graph before reading:
the window's summed softmax weights over every key (the two-pass Triton kernel of
attention/triton/window_scores.py reads the keys through the page table and skips blocks past the
live length), the top `budget` of a capacity-padded row (attention/top_k.py: a radix select on
CUDA), committed as slots into the refreshed rows by one kernel (attention/triton/token_slots.py).
The window is the conversation's last n - 1 queries (copied into a static buffer before the replay)
and the step's own (written by the graph). Per-row flags again: rows that do not re-select keep theirs. Warm-up steps read everything:
the plain graph. The graphed steps hand their queries to the conversation's observation window
(ProgressiveSelection.record_step). A layer whose tokens an eviction moved (stale), or a row whose
selection is not in the buffers (an eager step ran), re-selects in the graph too. Eager steps: a
batch that mixes warm-up and selecting conversations, and with RESCORE_IN_GRAPH = False every
re-selection (the fallback; the eager step's selection is then copied into `table`).

Host side per step: one extra asynchronous upload from pinned memory (the rows' read lengths and
whole/refresh flags), numpy over [L, H] per conversation, no device read. A conversation that moves
to another batch row takes its buffers along (one copy outside the graph); one whose buffers another
conversation overwrote selects again. On CPU the same steps run without a graph (CPU tests).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from turnkv.attention import decode, top_k
from turnkv.engine.cuda_graphs import GraphedDecode, _GraphStep

MAX_WHOLE_PAGES = 1 << 14  # physical pages a whole-list row may need before the step goes eager


def for_graphs(graphs: GraphedDecode) -> SelectionGraphs:
    """The selection graphs kept beside a GraphedDecode (made on first use)."""
    if getattr(graphs, "selection", None) is None:
        graphs.selection = SelectionGraphs(graphs)
    return graphs.selection


class SelectionGraphs:
    """Routes a batch of decode selectors to the handler of their kind and config."""

    def __init__(self, graphs: GraphedDecode):
        self.graphs = graphs
        self.handlers: dict = {}

    def handler(self, selectors):
        if not selectors or any(s is None or s.graph_config() is None for s in selectors):
            return None
        keys = set()
        for s in selectors:
            kind, config = s.graph_config()
            keys.add((kind, dataclasses.astuple(config)))
        if len(keys) != 1:
            return None
        key = keys.pop()
        if key not in self.handlers:
            kind, config = selectors[0].graph_config()
            Hq = self.graphs.queries.shape[2]
            cls = _PagedHandler if kind == "paged" else _ProgressiveHandler if kind == "progressive" else None
            self.handlers[key] = None if cls is None else cls(self.graphs, config, Hq)
        return self.handlers[key]

    def plan(self, seqs, selectors) -> _Plan | None:
        """What the graphed step must do for this batch, or None: run the eager step."""
        handler = self.handler(selectors)
        return None if handler is None or not handler.usable else handler.plan(seqs, selectors)

    def after_eager(self, seqs, selectors) -> None:
        """After an eager step of selecting conversations: copy what the graphs need from it."""
        handler = self.handler(selectors)
        if handler is not None and handler.usable:
            handler.after_eager(seqs, selectors)

    def close(self) -> None:
        for handler in self.handlers.values():
            if handler is not None:
                handler.graphs_by_key.clear()
        self.handlers.clear()


@dataclasses.dataclass
class _Plan:
    """variant(bucket, B) -> logits replaces GraphedDecode's replay (None: the plain graph);
    after(seqs) runs once the step succeeded."""

    variant: object
    after: object


class _Record:
    """A conversation's selection in a handler's buffers: which row, as of which begin() (ticks)."""

    def __init__(self, handler, num_layers: int, num_heads: int):
        self.handler = handler
        self.row: int | None = None
        self.ticks = -1
        self.version = -1
        self.valid = np.zeros(num_layers, dtype=bool)
        self.age = np.zeros(num_layers, dtype=np.int64)
        self.pages = np.zeros((num_layers, num_heads), dtype=np.int64)


class _Upload:
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


class _Handler:
    """What both kinds share: records, row ownership, capture and replay of their own graphs."""

    usable = True

    def __init__(self, graphs: GraphedDecode):
        self.graphs = graphs
        pool = graphs.pool
        self.L, self.H, self.B_max = pool.num_layers, pool.num_kv_heads, graphs.tables.shape[1]
        self.device = pool.device
        self.owner: list = [None] * self.B_max  # the selection state whose data each buffer row holds
        self.graphs_by_key: dict = {}

    def record(self, sel) -> _Record:
        rec = sel.graph_record
        if rec is None or rec.handler is not self:
            rec = sel.graph_record = _Record(self, self.L, self.H)
        return rec

    def in_buffers(self, sel, rec: _Record) -> bool:
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
        g = self.graphs
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


# ---- Quest / LServe -------------------------------------------------------------------------------


class _PagedHandler(_Handler):
    def __init__(self, graphs: GraphedDecode, config, num_query_heads: int):
        super().__init__(graphs)
        from turnkv.methods.lserve.decode import summaries_for

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
        self.upload = _Upload([L * B_max * H, L * B_max * H, L * B_max], dev)
        whole, read, refresh = self.upload.views
        self.whole, self.read = whole.view(L, B_max, H), read.view(L, B_max, H)
        self.refresh = refresh.view(L, B_max)
        layer = torch.arange(L, device=dev)[:, None, None]
        batch = torch.arange(B_max, device=dev)[None, :, None]
        # First cell of each row's page table in the graph's flat tables: [L, B, R, 1].
        self.row_base = (((layer * B_max + batch) * H + self.head_of_row) * self.P)[..., None]
        self.summaries = summaries_for(pool, cfg.logical_page) if self.usable else None

    # ---- host -----------------------------------------------------------------------------------
    def plan(self, seqs, sels) -> _Plan | None:
        cfg, K, L = self.config, self.K, self.L
        PP, ps = cfg.physical_page, self.graphs.pool.page_size
        moved = np.stack([sel.sync_all(seq) for sel, seq in zip(sels, seqs)])  # [B, L]; stats exact again
        recs = [self.record(sel) for sel in sels]
        for rec, m in zip(recs, moved):
            rec.valid[m] = False  # a selecting head's tokens moved: its selection names old pages
        lengths = np.stack([seq.lengths for seq in seqs]) + 1  # [B, L, H] once the step's token is in
        streaming = np.stack([sel.streaming_flags(seq) for sel, seq in zip(sels, seqs)])
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
            need = -(-lengths // ps)[whole & layer_selects[None, :, None]].max(initial=0)
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
                rec.valid[fresh], rec.age[fresh], rec.pages[fresh] = True, 0, sel_pages[b][fresh]
                rec.age[selecting[b]] += 1
                for layer in np.flatnonzero(fresh):
                    sel.state.selections[layer] += 1
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

        return _Plan(run, lambda seqs: None)

    def after_eager(self, seqs, sels) -> None:
        pass  # the eager step's begin() made the records stale: the next graphed step selects again

    # ---- inside the graph -------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, batch: int, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Score layer's pages for query q [batch, Hq, D], write the refreshed rows of `chosen`, and
        return layer's expanded tables and read lengths (see expand)."""
        from turnkv.methods.lserve.selector import graph_page_scores

        g, cfg = self.graphs, self.config
        lengths = g.lengths[layer, :batch]
        scores = graph_page_scores(q, self.summaries.kmax[layer], self.summaries.kmin[layer], g.tables[layer, :batch],
                                   lengths, self.num_phys, cfg, g.pool.page_size)  # [batch, R, num_phys]
        top = top_k.top_k_ascending(scores, min(self.K - 1, self.num_phys))
        if decode.uses_kernel(self.device):  # one kernel: sort and commit the refreshed rows, expand every row
            from turnkv.attention.triton import page_select

            table, read = page_select.expand_pages(self.chosen, self.whole, self.read, g.tables, g.lengths, layer, 1,
                                                   batch, kw, self.r, cfg.physical_page, top=top, refresh=self.refresh)
            return table[0], read[0]
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

    def __init__(self, runner: GraphedDecode, batch: int, handler: _PagedHandler, variant: str, kw: int):
        super().__init__(runner, batch)
        self.handler, self.variant, self.kw = handler, variant, kw
        self.dense_layers = handler.config.dense_layers if variant != "dense" else runner.pool.num_layers
        Hq, D = runner.queries.shape[2], runner.queries.shape[3]
        width = max(1, kw * handler.r) * runner.pool.page_size
        self.sel_splits = decode.num_splits(runner.pool.device, batch * handler.R, width, runner.pool.kv_dtype)
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

RESCORE_IN_GRAPH = True  # False: LoopServe's re-selection steps run eagerly (the slower fallback)


class _ProgressiveHandler(_Handler):
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
        self.upload = _Upload([L * B_max * H, L * B_max], dev)
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

    def plan(self, seqs, sels) -> _Plan | None:
        cfg, L, G = self.config, self.L, self.G
        steps = [sel.steps + 1 for sel in sels]
        warm = [n < cfg.warmup for n in steps]
        g = self.graphs
        if all(warm):  # warm-up reads everything: the plain graph
            def after(seqs):
                for b, sel in enumerate(sels):
                    sel.begin(True)
                    sel.record_step(g.queries[:, b], g.positions[b : b + 1])
            return _Plan(None, after)
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

        return _Plan(run, after)

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
        from turnkv.methods.loopserve.decode import window_scores

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
    from turnkv.methods.loopserve.decode import _Picked

    return _Picked(entries, counts, recent_from, step)


class _ProgressiveStep(_GraphStep):
    """The AttentionStep of a progressive-selection graph: every layer reads its rows' slot lists;
    variant "rescore" first makes the refreshed rows' selection again, layer by layer."""

    def __init__(self, runner: GraphedDecode, batch: int, handler: _ProgressiveHandler, variant: str):
        super().__init__(runner, batch)
        self.handler, self.variant = handler, variant
        Hq, D = runner.queries.shape[2], runner.queries.shape[3]
        self.sel_splits = decode.num_splits(runner.pool.device, batch * handler.R, handler.W, runner.pool.kv_dtype)
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
