"""What the state manager keeps beside a stored conversation: a pack in flight (Leaving), the entry's
meta, and the helpers that shape a pack for the tiers."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import build
from turnkv.state.background import PackJob


@dataclass(eq=False)
class Leaving:
    """A conversation whose pack runs on the packer: its pages are held until the job is taken."""

    conv: object
    tier: str
    strategy: StateStrategy
    job: PackJob | None = None
    stay: bool = False  # a resident pack: the conversation keeps its pages, and the tier gets a copy


def with_window(stored, window) -> tuple[dict, dict]:
    """(tensors, state) of a pack with the observation window beside it: it decides what later
    compressions keep, so it goes where the KV goes."""
    if window is None:
        return stored.tensors, stored.meta
    return {**stored.tensors, **window.to_tensors()}, {**stored.meta, "window.stored": True}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a packed tensor (pinned, so the copy from the device is a fast DMA)."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def params_of(strategy) -> dict:
    return {f.name: getattr(strategy, f.name) for f in fields(strategy) if f.init}


def strategy_of(spec: dict) -> StateStrategy:
    return build("state", spec["name"], spec["params"])


def entry_meta(record: dict, strategy, state: dict) -> dict:
    return {"strategy": {"name": strategy.name, "params": params_of(strategy)}, "state": state,
            "conversation": record}
