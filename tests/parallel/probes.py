"""Read-only looks into each rank's engine, through turnkv.parallel.mirror.gather (which pickles these
functions by name)."""

from __future__ import annotations


def krul_pairs(conv):
    """The layer pairs Krul chose at the conversation's last store (None before any)."""
    return getattr(conv.method_state.window, "last_pairs", None)
