"""The interface of the state axis: what a restoration strategy stores when a conversation leaves the
GPU, and how it rebuilds the KV when the conversation returns.

A strategy is a dataclass registered on the "state" axis. The state manager calls it at two points:
  pack(ctx, seq, queries) -> Stored   while the KV is still resident (turn end or demotion);
  restore(ctx, seq, tokens, meta, tensors) -> Pending | None   into an empty SequenceKV.
`ctx` is a RestoreContext: the model, the page pool and the calibrated costs. The token history is
always stored beside the state (by the manager), so every strategy can recompute what it did not keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from turnkv.methods.window import QueryWindow


@dataclass
class Stored:
    """What a strategy keeps: JSON meta and named tensors (device or host)."""

    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class StateStrategy:
    """Base of the state axis' components (mixed into each dataclass)."""

    # Whether a conversation leaves the GPU at every turn end ("state between turns"), or only when
    # the GPU tier needs room (the resident strategy).
    offloads_between_turns: ClassVar[bool] = True

    def query_window(self, num_layers: int, size: int) -> QueryWindow | None:
        """The per-conversation query recorder the engine fills during a turn; strategies that look at
        the turn's attention (Krul) record every query, others only what the eviction window needs."""
        return QueryWindow(num_layers, size) if size else None

    def pack(self, ctx, seq, window) -> Stored:
        raise NotImplementedError

    def restore(self, ctx, seq, tokens: list[int], meta: dict, tensors: dict[str, torch.Tensor]):
        raise NotImplementedError
