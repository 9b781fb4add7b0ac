"""Counting the calls that make the host wait for a GPU, on any device: reading values back (item,
tolist, cpu, numpy, bool, int, float), ops whose output size depends on values (nonzero, boolean
indexing, masked_select, unique, repeat_interleave without output_size) and torch.equal. A CUDA-free
test of the rule that the engine's per-layer paths queue work without waiting for it. On a CPU every
tensor is on the host, so a read of a tensor that is a host array on a GPU counts too. It cannot see
pageable copies (a CPU has none): tests/kv/test_token_slots.py checks those on CUDA."""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.nonzero, torch.Tensor.nonzero,
          torch.equal, torch.Tensor.equal, torch.masked_select, torch.Tensor.masked_select, torch.unique,
          torch.Tensor.unique, torch.unique_consecutive, torch.argwhere}
_SIZED = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_INDEX = {torch.Tensor.__getitem__}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """with HostReads() as reads: ...; reads.count, reads.by_op (call name -> count)."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.by_op[func.__name__] += 1
        elif func in _SIZED and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if func is torch.repeat_interleave else None)
            if isinstance(repeats, torch.Tensor):
                self.by_op["repeat_interleave without output_size"] += 1
        elif func in _INDEX and len(args) > 1 and _bool_index(args[1]):
            self.by_op["boolean indexing"] += 1
        return func(*args, **kwargs)
