"""What one conversation's recipe asks of a forward step: the StepContext the runner hands to Step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepContext:
    """The recipe's hooks into one conversation's forward steps. Every field's default is "nothing":
    dense attention over every kept token, nothing recorded.

    window: a QueryWindow that records each layer's last queries (eviction scorers read it).
    accumulate: add each query's attention weights to the mass kept beside the keys (H2O); a batch
        shares one value.
    pattern: the sparse prefill (a PatternHook), used by prefill chunks (T > 1) only:
        `pattern.chunk_windows(seqs, T)` first (the chunk on the engine's causal path, or
        None), else `pattern(layer, lines.Keys) -> out [B, Hq, T, D]` per layer.
    selector: the decode-selection state (begin / observe / entries per step, graph_config for the
        CUDA-graph step), or None: decode reads every kept token.
    """

    window: Any = None
    accumulate: bool = False
    pattern: Any = None
    selector: Any = None


PLAIN = StepContext()
