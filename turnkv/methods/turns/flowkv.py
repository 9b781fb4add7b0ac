"""FlowKV: each turn's segment is compressed exactly once, then frozen.

Based on "FlowKV: Enhancing Multi-Turn Conversational Coherence in LLMs via Isolated Key-Value Cache
Management". The system prompt, then each completed turn's query and response, is compressed once
with the recipe's scorer and budget and never rescored. The current turn stays whole while it runs.
The budget is a dynamic rule: the cache may hold
floor(keep * positions so far) per head, and a new segment gets what the frozen ones left, at least
`min_size` per head.

Parameters
----------
min_size : int, default 32
    Per-head floor of a new segment's budget (the paper's unspecified Min_Size).
reading : str, default "segment"
    "segment" (a turn's query and reply are compressed together when the next turn starts) or
    "query" (Algorithm 1 literally: the query is compressed right after its prefill; its reply is
    compressed with the next query).
system : str, default "next_query"
    When the system prompt is compressed: "next_query" with the first turn's prompt, scored with that
    query in view like every later segment; "own" as soon as it is prefilled, scored by its own last
    queries, so it is the same for every conversation that begins with it and they share its kept
    pages (the prefix index, turnkv/engine/prefix.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.protocols import Turns
from turnkv.methods.registry import register


@register("turns", "flowkv")
@dataclass
class FlowKVTurns(Turns):
    """FlowKV multi-turn isolation: compress each segment once, then freeze it."""

    min_size: int = 32
    reading: str = "segment"
    system: str = "next_query"

    def __post_init__(self):
        if self.reading not in ("segment", "query"):
            raise ValueError("reading must be 'segment' or 'query'")
        if self.system not in ("next_query", "own"):
            raise ValueError("system must be 'next_query' or 'own'")
        if self.min_size < 0:
            raise ValueError("min_size must be >= 0")

    @property
    def closes_prefix(self) -> bool:
        return self.system == "own"

    def span_start(self, frozen_upto: int) -> int:
        return frozen_upto

    def span_end(self, segment_end: int, next_position: int) -> int:
        return segment_end if self.reading == "segment" else next_position

    def keep_total(self, heads: int, target: int, kept_before: int, candidates: int, keep_ratio: float | None) -> int:
        room = heads * target - kept_before
        if kept_before:  # the floor protects later segments; the first one is compressed as the baseline does
            room = max(room, heads * self.min_size)
        return max(0, min(candidates, room))
