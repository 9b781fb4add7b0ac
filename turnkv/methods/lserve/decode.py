"""The decode axis `lserve` (and the selection `quest` shares, decode/quest.py): page selection by
per-page key min/max.

Each conversation gets a PagedSelection (its SelectionState, so batched conversations keep their own
reuse timers). The engine's Step hands it every K write (`written`), which folds the keys into the
PageSummaries shared by every conversation of the pool; each decode step's query (`observe`); and asks
per layer which entries to read (`entries`, engine/selection.py), which the indexed decode kernel reads.

Keeping the statistics exact: appends go through `written`; anything else that moves or drops a
head's tokens (eviction, streaming-head trimming, truncation, a restore) bumps SequenceKV.moves for
that head, and those heads are rebuilt from the pool before their statistics are read again.

Within budget (every selecting head holds at most `budget` tokens) `entries` answers None and the step
reads the paged tables unchanged: exactly dense decode. Streaming heads (LServe with a head pattern)
never select: they read their whole table, which the static-sparsity axis keeps at sink + local.
"""

from __future__ import annotations

import weakref
from dataclasses import astuple, dataclass
from typing import NamedTuple

import numpy as np
import torch

from turnkv.gpu import upload
from turnkv.methods.lserve.selector import PageSelector, SelectionState, SelectorConfig
from turnkv.methods.lserve.summaries import PageSummaries
from turnkv.methods.protocols import Decode, DecodeSelection, StaticSparsity, WriteWatcher
from turnkv.methods.registry import register

# One PageSummaries per (pool, logical page size), made when the first conversation needs it.
_SUMMARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def summaries_for(pool, logical_page: int) -> PageSummaries:
    per_pool = _SUMMARIES.setdefault(pool, {})
    if logical_page not in per_pool:
        per_pool[logical_page] = PageSummaries(pool, logical_page)
    return per_pool[logical_page]


@register("decode", "lserve")
@dataclass
class LServeDecode(Decode):
    """LServe hierarchical paging: 64-token pages scored by their 16-token pages' key min/max, reused 4 steps.

    budget: tokens each head reads (4096). physical_page / logical_page: 64 / 16. reuse: decode steps
    a selection serves (4). group: "query" (select per query head, as LServe's code), "max" or "sum"
    (per KV head, the group's scores reduced)."""

    path_independent = True  # PagedSelection: selects afresh at every prefill, statistics from the pool

    budget: int = 4096
    physical_page: int = 64
    logical_page: int = 16
    reuse: int = 4
    group: str = "query"

    def __post_init__(self):
        self.selector_config()

    def selector_config(self) -> SelectorConfig:
        return SelectorConfig(physical_page=self.physical_page, logical_page=self.logical_page,
                              token_budget=self.budget, reuse_interval=self.reuse, group=self.group)

    def new_state(self, num_layers: int) -> PagedSelection:
        return PagedSelection(self.selector_config(), num_layers)


class Query(NamedTuple):
    """A decode step's query of one conversation in one layer: row `row` of `rows` [n, Hq, D] (a view
    of the step's one-token queries, shared by the conversations observed together)."""

    rows: torch.Tensor
    row: int


class PagedSelection(DecodeSelection, WriteWatcher):
    """One conversation's page selection; the engine calls begin() per forward step, written() and
    observe() per layer (or, for conversations of equal keys, observe_batch() and step_writes() over
    them), and entries() per layer of a decode step. The CUDA-graph decode
    (engine/graph_selection.py) keeps its selections in the graph's buffers instead and drives this
    state through sync_all() and the fields below; `ticks` (bumped by every begin()) tells it whether
    an eager step ran since it last wrote them."""

    def __init__(self, config: SelectorConfig, num_layers: int):
        self.selector = PageSelector(config)
        self._config_key = astuple(config)  # batch_key's part for the selector
        self.state = SelectionState(num_layers)
        self.static = None  # the recipe's streaming-heads component (LServe), whose heads never select
        self._flags = None  # (shape [L, H], streaming flags, batch_key per layer), made at the first call
        self.queries: list[Query | None] = [None] * num_layers  # the step's last query [Hq, D]
        # The statistics are exact for the heads whose SequenceKV.moves match these (per layer).
        self._synced_seq = None
        self._synced_moves: np.ndarray | None = None
        self._synced_ok = np.zeros(num_layers, dtype=bool)
        self._exact_at = -1  # `ticks` of the step that began with every layer's statistics exact
        self.steps = 0  # decode steps in this turn
        self.ticks = 0  # begin() calls, ever
        self._selections_before = 0
        self.graph_record = None  # engine/graph_selection.py's bookkeeping for this conversation

    @property
    def selections(self) -> int:
        """Fresh selections this turn, summed over the layers (a layer whose heads are all streaming
        heads never selects)."""
        return sum(self.state.selections) - self._selections_before

    def graph_config(self):
        """What the graphed decode keys its buffers and graphs by (engine/graph_selection.py)."""
        return ("paged", self.selector.config)

    def begin(self, decoding: bool) -> None:
        self.ticks += 1
        if not decoding:  # a prefill changes the pages: a new turn selects afresh
            self.state.invalidate()
            self.steps, self._selections_before = 0, sum(self.state.selections)
        else:
            self.steps += 1

    def discard_step(self, seq, position: int) -> None:
        """A decode step at `position` was launched and then dropped (its generation had already
        stopped; engine/decode_loop.py). Its key was folded into its page's statistics: rebuild them
        from the kept keys at the next sync, and select afresh. A selection it made stays counted."""
        self.steps -= 1
        self._synced_ok[:] = False
        self.state.invalidate()

    def observe(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Keeps a decode step's query, which its entries() scores the pages with. A prefill chunk's
        queries are never scored (the next decode step observes its own first), and a view of their
        last row would keep the chunk's whole QKV output alive: nothing is kept from them."""
        self.queries[layer] = Query(q[-1:], 0) if q.shape[0] == 1 else None

    @classmethod
    def observe_batch(cls, layer: int, selections, q: torch.Tensor, positions: torch.Tensor) -> None:
        """observe() of n conversations, q [n, T, Hq, D]: a one-token step keeps one view of its queries."""
        rows = q[:, 0] if q.shape[1] == 1 else None
        for i, sel in enumerate(selections):
            sel.queries[layer] = None if rows is None else Query(rows, i)

    def exclude_static(self, static: StaticSparsity) -> None:
        self.static = static
        self._flags = None

    def written(self, layer: int, seq, slots: torch.Tensor, k: torch.Tensor) -> None:
        summaries = summaries_for(seq.pool, self.selector.config.logical_page)
        streaming = self._streaming(seq, layer)
        T, H = k.shape[0], k.shape[1]
        heads = None
        if streaming.any():
            # Streaming heads never select: only the selecting heads' keys are folded.
            heads = np.flatnonzero(~streaming).tolist()
            if not heads:
                return
        summaries.update_runs(layer, slots.view(1, H, T), k[None], heads)
        if T * (H if heads is None else len(heads)) == int(seq.lengths[layer][~streaming].sum()):
            # Every token the layer holds was written here (a fresh sequence's first chunk): the update
            # made its statistics exact, with nothing to rebuild.
            self._mark_synced(layer, seq)
            return
        self._sync(layer, seq, summaries)  # after the update: a rebuild reads the new keys too

    def write_key(self, seq):
        """Conversations of equal selector configs and streaming heads fold a step's keys together."""
        return self._config_key, self.streaming_flags(seq).tobytes()

    @classmethod
    def step_writes(cls, seqs, selections, num_new: int):
        """written() of n conversations of equal write_key, per layer: one update_runs over all their
        keys, then the host bookkeeping of the conversations it changes (those whose layer the step
        filled, or whose statistics were not exact when the step began; for the others `_sync` finds
        nothing to do, in `written` and in entries_batch alike)."""
        summaries = summaries_for(seqs[0].pool, selections[0].selector.config.logical_page)
        streaming = selections[0].streaming_flags(seqs[0])  # [L, H], the group's
        lengths = np.stack([seq.lengths for seq in seqs])  # [n, L, H], the step's tokens included
        # A layer whose selecting heads hold only the step's tokens (a fresh sequence's first chunk).
        filled = ((lengths == num_new) | streaming).all(axis=2)  # [n, L]
        exact = np.array([sel._exact(seq) for sel, seq in zip(selections, seqs)], dtype=bool)
        for sel, ok in zip(selections, exact):
            sel._exact_at = sel.ticks if ok else -1
        host = filled | ~exact[:, None]
        heads = [None if not row.any() else np.flatnonzero(~row).tolist() for row in streaming]

        def written(layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
            if heads[layer] == []:  # streaming heads only: nothing is folded
                return
            summaries.update_runs(layer, slots, k, heads[layer])
            for i in np.flatnonzero(host[:, layer]).tolist():
                if filled[i, layer]:
                    selections[i]._mark_synced(layer, seqs[i])
                else:
                    selections[i]._sync(layer, seqs[i], summaries)

        return written

    def _exact(self, seq) -> bool:
        """Whether every layer's statistics are exact for `seq`: no selecting head moved since its last
        sync. Streaming heads keep no statistics: their moves are taken as synced here, as `_sync`
        would take them (the trim moves them every page of decode)."""
        if self._synced_seq is not seq or not self._synced_ok.all():
            return False
        if np.array_equal(self._synced_moves, seq.moves):
            return True
        streaming = self.streaming_flags(seq)
        if not np.array_equal(self._synced_moves[~streaming], seq.moves[~streaming]):
            return False
        self._synced_moves[streaming] = seq.moves[streaming]
        return True

    def _mark_synced(self, layer: int, seq) -> None:
        if self._synced_seq is not seq:
            self._synced_seq, self._synced_moves = seq, seq.moves.copy()
            self._synced_ok[:] = False
        self._synced_moves[layer] = seq.moves[layer]
        self._synced_ok[layer] = True

    def _sync(self, layer: int, seq, summaries: PageSummaries) -> bool:
        """Rebuild the statistics of the selecting heads whose tokens moved since they were last exact
        (streaming heads never select: their statistics are not kept). Returns whether a selecting
        head moved (a cached selection then names pages of the old layout and is dropped)."""
        moves = seq.moves[layer]
        if self._synced_seq is not seq:
            self._synced_seq, self._synced_moves = seq, seq.moves.copy()
            self._synced_ok[:] = False
        elif self._synced_ok[layer] and np.array_equal(self._synced_moves[layer], moves):
            return False
        heads = np.arange(len(moves)) if not self._synced_ok[layer] else np.flatnonzero(moves != self._synced_moves[layer])
        selecting = heads[~self._streaming(seq, layer)[heads]]
        if len(selecting):
            summaries.rebuild_heads(seq, layer, selecting)
            self.state.chosen[layer] = None
        self._synced_moves[layer] = moves
        self._synced_ok[layer] = True
        return bool(len(selecting))

    def sync_all(self, seq) -> np.ndarray:
        """_sync every layer (host checks only, unless something moved); -> [L] bool, the layers where
        a selecting head moved."""
        L = seq.lengths.shape[0]
        moved = np.zeros(L, dtype=bool)
        if self._exact(seq):
            return moved
        summaries = summaries_for(seq.pool, self.selector.config.logical_page)
        for layer in range(L):
            moved[layer] = self._sync(layer, seq, summaries)
        return moved

    def entries(self, layer: int, seq):
        """What this decode step reads in `layer` (engine/selection.py), or None: everything."""
        width = int(seq.num_pages[layer].max())
        picked = self.entries_batch(layer, [seq], [self], seq.device_table()[layer][None, :, :width])
        return None if picked is None else (picked[1][0], picked[2][0])

    def batch_key(self, layer: int, seq):
        """Conversations of equal selector configs and streaming heads share one select per layer."""
        self.streaming_flags(seq)
        return self._flags[2][layer]

    @classmethod
    def entries_batch(cls, layer: int, seqs, selections, tables: torch.Tensor):
        """`entries` of conversations of equal batch_key (DecodeSelection.entries_batch): one select
        over those whose selecting heads are over budget, each with its own SelectionState."""
        cfg = selections[0].selector.config
        summaries = summaries_for(seqs[0].pool, cfg.logical_page)
        for sel, seq in zip(selections, seqs):
            if sel._exact_at != sel.ticks:  # else exact since the step began (step_writes)
                sel._sync(layer, seq, summaries)
        lengths = np.stack([seq.lengths[layer] for seq in seqs])  # [n, H], this step's token included
        streaming = selections[0]._streaming(seqs[0], layer)
        pages = -(-lengths // cfg.physical_page)
        over = np.where(streaming, 0, pages).max(axis=1, initial=0) > cfg.pages_budget  # [n]
        if layer < cfg.dense_layers or not over.any():
            return None  # no selection while the history is within budget
        which = np.flatnonzero(over)
        device = seqs[0].pool.device
        if len(which) < len(seqs):
            tables = tables.index_select(0, upload(which, tables.device))
        states = [selections[i].state for i in which]
        queries = _stack_queries([selections[i].queries[layer] for i in which])  # [m, Hq, D]
        dense = torch.from_numpy(~streaming) if streaming.any() else None
        selections[0].selector.select(layer, queries, tables, upload(lengths[which], device), summaries,
                                      states, dense, host_lengths=lengths[which], tables_out=False)
        # [m, X, K]: a selection made over budget has K = pages_budget (it had more pages than that).
        chosen = torch.stack([s.chosen[layer] for s in states])
        return (which, *_to_entries(chosen, lengths[which], streaming, cfg.physical_page))

    def streaming_flags(self, seq) -> np.ndarray:
        """[L, H] bool: the heads that never select (LServe's streaming heads). Read only: one array
        serves every call for a model's shape."""
        shape = seq.lengths.shape
        if self._flags is None or self._flags[0] != shape:
            L, H = shape
            flags = np.zeros((L, H), dtype=bool) if self.static is None else self.static.flags(L, H)
            self._flags = (shape, flags, [(self._config_key, row.tobytes()) for row in flags])
        return self._flags[1]

    def _streaming(self, seq, layer: int) -> np.ndarray:
        return self.streaming_flags(seq)[layer]


def _stack_queries(queries: list[Query]) -> torch.Tensor:
    """The queries [m, Hq, D] (contiguous): the observed rows themselves where they are all of them."""
    rows = queries[0].rows
    if all(q.rows is rows for q in queries):
        index = [q.row for q in queries]
        if index == list(range(rows.shape[0])):
            return rows.contiguous()
        return rows.index_select(0, upload(np.asarray(index), rows.device))
    return torch.stack([q.rows[q.row] for q in queries])


def _to_entries(chosen: torch.Tensor, lengths: np.ndarray, streaming: np.ndarray, page: int):
    """Physical page ids [n, X, K] of n conversations (per row ascending, the newest last for heads
    over budget, 0..K-1 for heads within it), their heads' lengths [n, H] and the streaming heads [H]
    -> the token entries each row reads [n, X, W] and their counts [n, X]. Streaming rows read their
    whole list."""
    n, X, K = chosen.shape
    group = X // lengths.shape[1]
    row_len = np.repeat(lengths, group, axis=1)
    row_pages = -(-row_len // page)
    read = np.minimum(row_pages, K)
    # Every chosen page is full except the newest, whose tokens end the row.
    counts = np.where(row_len > 0, (read - 1) * page + row_len - (row_pages - 1) * page, 0)
    entries = (chosen[..., None] * page + torch.arange(page, device=chosen.device)).reshape(n, X, K * page)
    rows_streaming = np.repeat(streaming, group)
    if rows_streaming.any():
        width = max(K * page, int(row_len[:, rows_streaming].max()))
        entries = torch.nn.functional.pad(entries, (0, width - entries.shape[2]))
        everything = torch.arange(width, device=chosen.device)
        entries = torch.where(upload(rows_streaming, chosen.device)[:, None], everything, entries)
        counts = np.where(rows_streaming, row_len, counts)
    return entries, counts.astype(np.int64)
