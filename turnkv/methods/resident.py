"""Conversation state stays where it was computed, between turns."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.registry import register


@register("state", "gpu")
@dataclass
class Resident:
    """Keep each conversation's KV resident on its device between turns."""
