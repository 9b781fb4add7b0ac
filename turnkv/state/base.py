"""What a state strategy stores when a conversation leaves the GPU (its interface, StateStrategy, is
in turnkv.methods.protocols with the other axes')."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Stored:
    """What a strategy keeps: JSON meta and named tensors (device or host)."""

    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
