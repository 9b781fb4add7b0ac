"""A prefill chunk as causal attention within per-head windows: what Prefill.chunk_windows returns
(turnkv/methods/protocols.py), which the engine runs on its own paths (engine/step.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_WINDOW = 1 << 30  # a ChunkWindows window past any position: the head sees every kept key


@dataclass
class ChunkWindows:
    """A prefill chunk as causal attention over the kept keys within windows (Prefill.chunk_windows).

    windows : np.ndarray or None
        [L, H] int: a key at position k is seen by the row at position p when p - k < windows[l, h]
        or k < sink. None: every kept key up to the row (no window anywhere).
    sink : int
    computed, causal : np.ndarray
        [L, B, H] the chunk's attention cells computed and its causal cells, as `attend`'s stats
        count them."""

    windows: np.ndarray | None
    sink: int
    computed: np.ndarray
    causal: np.ndarray
