"""Conversation state stays where it was computed, between turns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from turnkv.methods.registry import register
from turnkv.state.load import LoadStrategy


@register("state", "gpu")
@dataclass
class GPUStrategy(LoadStrategy):
    """Keep each conversation's KV resident on its device between turns. When the GPU tier needs
    room, the least recently used conversation moves down with its full KV (restored like `load`)."""

    offloads_between_turns: ClassVar[bool] = False


@register("state", "resident")
@dataclass
class ResidentStrategy(GPUStrategy):
    """Another name for the `gpu` strategy: the KV stays in the page pool between turns (in host memory
    on a CPU engine, where the pool's tier is still called gpu)."""
