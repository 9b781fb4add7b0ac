"""The streaming (Λ-shaped) mask: query i sees key j iff j <= i and (j < sink or j > i - local).

Token-exact, as Block-Sparse-Attention's streaming mask. Shared by calibration and gate
training so that both measure the same window the engine will serve."""

from __future__ import annotations

import torch


def streaming_mask(num_tokens: int, sink: int, local: int, device=None) -> torch.Tensor:
    """[T, T] bool, True = attend."""
    if sink < 0 or local < 1:
        raise ValueError(f"need sink >= 0 and local >= 1, got sink={sink}, local={local}")
    i = torch.arange(num_tokens, device=device)[:, None]
    j = torch.arange(num_tokens, device=device)[None, :]
    return (j <= i) & ((j < sink) | (j > i - local))


def outside_mask(num_tokens: int, sink: int, local: int, device=None) -> torch.Tensor:
    """[T, T] bool: the causal keys the streaming mask drops."""
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
    return causal & ~streaming_mask(num_tokens, sink, local, device)
