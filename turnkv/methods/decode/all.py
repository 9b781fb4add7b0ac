"""Decode reads every kept token."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.protocols import Decode
from turnkv.methods.registry import register


@register("decode", "all")
@dataclass
class AllDecode(Decode):
    """Each decode step attends to every token the store keeps."""

    selects = False
    path_independent = True

    def new_state(self, num_layers: int) -> None:
        return None
