"""The CPU tier's memory: one host buffer allocated (and pinned, where CUDA exists) once, at start-up.

Pinning per request is slow and fragments the driver's pinned allocations; copies from pageable
memory do not overlap with compute. So the tier carves stored tensors out of one buffer, with a
first-fit extent allocator that coalesces free neighbours. An entry's tensors are allocated
all-or-nothing.
"""

from __future__ import annotations

import bisect
import logging

import torch

log = logging.getLogger("turnkv.kv")

ALIGN = 512  # bytes; keeps every tensor aligned for any dtype and for fast DMA


class HostPool:
    def __init__(self, capacity: int, pin: bool | None = None):
        if capacity < ALIGN:
            raise ValueError(f"a host pool needs at least {ALIGN} bytes")
        self.capacity = capacity - capacity % ALIGN
        pin = torch.cuda.is_available() if pin is None else pin
        try:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:  # the driver pins less than the host has (torch.AcceleratorError too)
            if not pin:
                raise
            log.warning("could not pin %.1f GiB of host memory for the CPU tier (%s); it uses pageable memory, "
                        "whose copies to the GPU are slower and do not overlap compute: ask for less "
                        "(state_cpu_memory / --state-cpu-memory)", self.capacity / 2**30, str(e).splitlines()[0])
            self.buffer, pin = torch.empty(self.capacity, dtype=torch.uint8), False
        self.pinned = pin
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self.used = 0

    def free_bytes(self) -> int:
        return self.capacity - self.used

    @staticmethod
    def footprint(tensors: dict[str, torch.Tensor]) -> int:
        return sum(_aligned(t.numel() * t.element_size()) for t in tensors.values())

    def store(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Copy the tensors into the pool; None (and nothing taken) when they do not fit. Copies from a
        GPU into pinned memory are queued together and waited for once: done when this returns."""
        views = self.take_like(tensors)
        if views is not None:
            devices = set()
            for name, t in tensors.items():
                queued = self.pinned and t.device.type == "cuda"
                views[name].copy_(t, non_blocking=queued)
                if queued:
                    devices.add(t.device)
            for device in devices:
                torch.cuda.current_stream(device).synchronize()
        return views

    def take_like(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Uninitialised views of the pool with each tensor's shape and dtype (the caller fills them and
        gives them back with `release`); None (and nothing taken) when they do not fit."""
        extents = []
        for t in tensors.values():
            extent = self._take(_aligned(t.numel() * t.element_size()))
            if extent is None:
                for e in extents:
                    self._give(*e)
                return None
            extents.append(extent)
        return {name: self.buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for (name, t), (offset, _) in zip(tensors.items(), extents)}

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        for t in tensors.values():
            # The offset from the storage, not data_ptr(): an empty tensor's data_ptr() is 0.
            self._give(t.storage_offset() * t.element_size(), _aligned(t.numel() * t.element_size()))

    # ---- extent allocator -------------------------------------------------------------------
    def _take(self, size: int) -> tuple[int, int] | None:
        if size == 0:
            size = ALIGN  # a zero-size tensor still needs a distinct address to be released
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.used += size
                return offset, size
        return None

    def _give(self, offset: int, size: int) -> None:
        size = size or ALIGN
        self.used -= size
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)
