"""Paged chunk attention on any device: a chunk of new tokens over the kept history and itself, read
from the page pool. The Triton kernel (turnkv/attention/triton/chunk_prefill.py) where it is switched
on, the reference path (reference.paged_chunk: gather the pages, mask, SDPA) elsewhere; both take the
same arguments.

Switch: the kernel is on by default for CUDA devices. TURNKV_CHUNK_KERNEL=0 in the environment (read at
import) or `chunk.ENABLED = False` turns it off; `chunk.FORCE = True` also runs it off CUDA (Triton's
interpreter on CPU), for tests. Both are read when a Step is built.
"""

from __future__ import annotations

import functools
import os

import torch

from turnkv.attention import reference
from turnkv.attention.triton import available

ENABLED = os.environ.get("TURNKV_CHUNK_KERNEL", "1") != "0"
FORCE = False


@functools.cache
def _kernel():
    if not available():
        return None
    from turnkv.attention.triton import chunk_prefill

    return chunk_prefill


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def uses_kernel(device: torch.device) -> bool:
    """Whether later chunks on `device` take the kernel (switched on, CUDA or forced, Triton present)."""
    return ENABLED and (device.type == "cuda" or FORCE) and _kernel() is not None


def num_splits(device: torch.device, batch_kv_heads: int, num_new: int, group: int, max_length: int,
               dtype: torch.dtype) -> int:
    """Key splits for a chunk of num_new tokens over heads of at most max_length entries (1 off CUDA)."""
    if device.type != "cuda" or not uses_kernel(device):
        return 1
    kernel = _kernel()
    block_m = kernel.launch_config(dtype, 128)["block_m"]
    blocks = -(-group * num_new // block_m)
    return kernel.choose_splits(batch_kv_heads, blocks, max_length, _num_sms(device.index or 0))


def paged_chunk(q, k_cache, v_cache, table, lengths, splits: int = 1, scale=None, window=None,
                key_positions=None, query_positions=None, k_scale=None, v_scale=None, sink: int = 0) -> torch.Tensor:
    """q [B, Hq, T, D] -> [B, Hq, T, D]: the T new tokens (the last T entries of every head, stored)
    over table [B, H, P] and lengths [B, H] on q's device; see reference.paged_chunk (window: an int or
    an int32 tensor [H], one per KV head; keys below `sink` stay in every window). A quantized pool
    (PagePool.scale_kwargs) adds k_scale / v_scale beside its codes."""
    if uses_kernel(q.device) and _kernel().supports(q, k_cache):
        return _kernel().chunk_attention(q, k_cache, v_cache, table, lengths, splits, scale, window, key_positions,
                                         query_positions, k_scale, v_scale, sink=sink)
    return reference.paged_chunk(q, k_cache, v_cache, table, lengths, scale, window, key_positions, query_positions,
                                 k_scale, v_scale, sink)
