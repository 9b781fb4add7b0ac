"""Indexed decode attention on any device: the Triton kernel on CUDA, the reference path elsewhere.
Both take the same arguments (see reference.indexed_decode)."""

from __future__ import annotations

import functools

import torch

from turnkv.attention import reference
from turnkv.attention.triton import available
from turnkv.gpu import num_sms


@functools.cache
def _kernel():
    if not available():
        return None
    from turnkv.attention.triton import decode

    return decode


def uses_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel() is not None


def num_splits(device: torch.device, batch_kv_heads: int, max_length: int, kv_dtype: torch.dtype | None = None,
               selected: bool = False) -> int:
    """How many chunks the kernel cuts each key list into (1 off CUDA); kv_dtype: the store's.
    selected: the lists are a decode selection's pages or tokens (a few thousand keys a row), which
    are latency-bound and take more, shorter chunks (SELECTED_PROGRAMS_PER_SM)."""
    if not uses_kernel(device):
        return 1
    kernel = _kernel()
    per_sm = kernel.PROGRAMS_PER_SM.get(kv_dtype, 4)
    if selected:
        per_sm = max(per_sm, kernel.SELECTED_PROGRAMS_PER_SM)
    return kernel.choose_splits(batch_kv_heads, max_length, num_sms(device.index or 0), programs_per_sm=per_sm)


def indexed_decode(q, k_cache, v_cache, table, lengths, splits: int = 1, scale=None, window=None,
                   key_positions=None, query_positions=None, out=None, workspace=None, k_scale=None, v_scale=None):
    """q [B, Hq, D] -> [B, Hq, D]; table [B, H, P] and lengths [B, H] as int32 on q's device.
    A quantized pool (PagePool.scale_kwargs) adds k_scale / v_scale beside its codes."""
    if uses_kernel(q.device):
        return _kernel().indexed_decode(q, k_cache, v_cache, table, lengths, splits, scale, window,
                                        key_positions, query_positions, out, workspace,
                                        k_scale=k_scale, v_scale=v_scale)
    result = reference.indexed_decode(q, k_cache, v_cache, table, lengths, scale, window, key_positions,
                                      query_positions, k_scale, v_scale)
    return result if out is None else out.copy_(result)
