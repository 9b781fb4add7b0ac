"""Dense prefill: every new token attends to every kept token and to the new ones before it."""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.registry import register


@register("prefill", "dense")
@dataclass
class Dense:
    """Dense causal prefill (no sparsity)."""
