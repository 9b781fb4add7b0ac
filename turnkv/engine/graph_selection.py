"""Decode selection inside the CUDA-graph decode step: Quest / LServe page selection and LoopServe's
progressive decode, replayed from graphs instead of run eagerly with per-layer host work.

Quest / LServe (`_PagedHandler`): `chosen` [L, B, R, K] holds the K = pages_budget physical pages each
row reads (R = query heads for group="query", else KV heads), the K - 1 best ascending, the newest last;
variants "select", "reuse" and "dense" per bucket. LoopServe (`_ProgressiveHandler`): `table`
[L, B, R, W] holds the pool slots each row reads (the selection ascending, then the tokens since);
variants "progressive" and "rescore". Both take the eager selector's choices, with per-row refresh flags.
Design: docs/architecture.md#decode-selection-inside-the-graphs"""


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
        kind, config = selectors[0].graph_config()
        for s in selectors[1:]:  # one kind and equal configs (compared field by field, not copied out)
            other_kind, other = s.graph_config()
            if other_kind != kind or not (other is config or (type(other) is type(config) and other == config)):
                return None
        key = (kind, dataclasses.astuple(config))
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


