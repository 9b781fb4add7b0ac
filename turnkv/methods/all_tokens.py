"""Decode reads every kept token."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.registry import register


@register("decode", "all")
@dataclass
class AllTokens:
    """Each decode step attends to every token the store keeps."""
