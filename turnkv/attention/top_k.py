"""The k largest scores of each row, as indices in ascending order, on any device. On CUDA, Triton
kernels: rows of at most MAX_ROW scores are sorted by one program each (turnkv/attention/triton/
top_k.py), longer rows go through a radix select (radix_top_k.py); both give ties at the threshold
to the lowest indices. Elsewhere torch.topk and a sort (ties: torch's choice). The decode selections
call this in their eager and graphed steps alike, so the two pick the same tokens and pages on
either device."""

from __future__ import annotations

import torch

from turnkv.attention import decode


def top_k_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., n] (no NaN), 1 <= k <= n -> int64 indices [..., k], ascending."""
    if decode.uses_kernel(scores.device):
        from turnkv.attention.triton import top_k

        if scores.shape[-1] <= top_k.MAX_ROW:
            return top_k.top_k_ascending(scores.float(), k)
        from turnkv.attention.triton import radix_top_k

        return radix_top_k.top_k_ascending(scores.float(), k)
    return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def top_k_candidates(scores: torch.Tensor, k: int) -> torch.Tensor:
    """On CUDA (the Triton kernels) only: scores [..., n] (no NaN), k >= 1 -> int64 keys [..., C]
    among which are each row's k best, for a kernel that finishes the selection in its own program
    (triton/top_k.py merge_ascending): the parts' best keys of a short row, the radix select's winners
    of a long one."""
    from turnkv.attention.triton import top_k

    if scores.shape[-1] <= top_k.MAX_ROW:
        return top_k.candidates(scores.float(), k)
    from turnkv.attention.triton import radix_top_k

    return top_k.as_candidates(radix_top_k.top_k_ascending(scores.float(), k))
