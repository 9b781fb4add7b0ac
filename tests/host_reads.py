"""Counting the ops that make the host wait for a GPU, on any device: reading a value back (item,
bool), ops whose output size depends on values (nonzero, boolean indexing, masked_select, unique,
repeat_interleave without output_size) and torch.equal. A CUDA-free test of the rule that the
engine's per-layer paths queue work without waiting for it. It cannot see pageable copies (a CPU has
none): tests/kv/test_token_slots.py checks those on CUDA."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
           aten._unique2, aten.unique_dim, aten.unique_consecutive}


class HostReads(TorchDispatchMode):
    """with HostReads() as reads: ...; reads.count, reads.by_op (op name -> count)."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _ALWAYS:
            self.by_op[str(packet)] += 1
        elif packet is aten.repeat_interleave and kwargs.get("output_size") is None and \
                isinstance(args[1] if len(args) > 1 else args[0], torch.Tensor):  # repeats from a tensor
            self.by_op["repeat_interleave without output_size"] += 1
        elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())):
            self.by_op[f"{packet} with a boolean mask"] += 1
        return func(*args, **kwargs)
