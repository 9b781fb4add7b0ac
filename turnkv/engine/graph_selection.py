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

from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.engine.graph_handler import Plan
from turnkv.engine.graph_paged import PagedHandler
from turnkv.engine.graph_progressive import ProgressiveHandler


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
            cls = PagedHandler if kind == "paged" else ProgressiveHandler if kind == "progressive" else None
            self.handlers[key] = None if cls is None else cls(self.graphs, config, Hq)
        return self.handlers[key]

    def plan(self, seqs, selectors) -> Plan | None:
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


