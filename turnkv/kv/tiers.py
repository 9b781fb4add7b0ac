"""Where stored conversation state lives off the GPU: a pinned CPU tier and a disk tier, with
capacity limits and least-recently-used demotion CPU -> disk.

The GPU tier is the page pool itself; turnkv.state.manager moves conversations between it and this
store. An entry is (meta, tensors): meta is JSON (it becomes the disk manifest, with the token
history the caller puts in it), tensors are what a restoration strategy chose to keep.

Nothing is dropped to make room. Entries are demoted to disk, oldest use first; when the disk is
full as well, `put` raises StateTiersFullError and every entry stays where it was (the caller still
holds the state it tried to store). The disk's use order is kept in the manifests, so it survives a
restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from turnkv.errors import KVCacheFullError
from turnkv.kv.disk import DiskStore
from turnkv.kv.host_pool import HostPool

TIERS = ("gpu", "cpu", "disk")


class StateTiersFullError(KVCacheFullError):
    """Every state tier is full: nothing was stored or dropped; the state is still where it was.
    A KVCacheFullError: a request that needed GPU room for it gets no room, and loses nothing."""


class TieredStore:
    def __init__(self, cpu_bytes: int = 0, disk_dir=None, disk_bytes: int | None = None, pin: bool | None = None):
        self.cpu_bytes, self._pin, self._host = cpu_bytes, pin, None
        self.disk = DiskStore(disk_dir) if disk_dir is not None else None
        self.disk_bytes = disk_bytes
        self._cpu: OrderedDict[str, tuple[dict, dict[str, torch.Tensor]]] = OrderedDict()  # LRU first

    @property
    def host(self) -> HostPool | None:
        """The CPU tier's pool, allocated (and pinned) once, on first use; None without a CPU tier."""
        if self._host is None and self.cpu_bytes:
            self._host = HostPool(self.cpu_bytes, self._pin)
        return self._host

    @property
    def host_allocated(self) -> bool:
        return self._host is not None

    # ---- queries ----------------------------------------------------------------------------
    def tier_of(self, key: str) -> str | None:
        if key in self._cpu:
            return "cpu"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def keys(self, tier: str) -> list[str]:
        if tier == "cpu":
            return list(self._cpu)
        return self.disk.ids() if (tier == "disk" and self.disk is not None) else []

    def stored_bytes(self, key: str) -> int:
        """Bytes of the entry's tensors (payload only, as a strategy's storage is compared)."""
        if key in self._cpu:
            return sum(t.numel() * t.element_size() for t in self._cpu[key][1].values())
        if self.disk is not None and key in self.disk:
            return int(self.disk.manifest(key)["payload_bytes"])
        raise KeyError(key)

    def usage(self) -> dict:
        return {"cpu_used": self._host.used if self._host else 0, "cpu_capacity": self.cpu_bytes,
                "disk_used": self.disk.bytes_used() if self.disk else 0, "disk_capacity": self.disk_bytes,
                "cpu_entries": len(self._cpu), "disk_entries": len(self.disk.ids()) if self.disk else 0}

    def meta(self, key: str) -> dict:
        if key in self._cpu:
            return self._cpu[key][0]
        return self.disk.manifest(key)

    # ---- moves ------------------------------------------------------------------------------
    def put(self, key: str, meta: dict, tensors: dict[str, torch.Tensor], tier: str = "cpu", keep=(),
            spare=()) -> str:
        """Store an entry in `tier` (or the next one down when it cannot hold it); returns the tier.
        keep: keys of CPU entries not to demote to make room (their host memory is being read).
        spare: keys of entries that only copy what is still on the GPU: deleted first to make room."""
        if tier not in ("cpu", "disk"):
            raise ValueError(f"state can be stored in the cpu or disk tier, not {tier!r}")
        meta = {**meta, "payload_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        if tier == "cpu" and self.host is not None:
            need = HostPool.footprint(tensors)
            if need <= self.host.capacity:
                self._make_cpu_room(need, exclude={key, *keep}, spare=spare)
                stored = self.host.store(tensors)
                if stored is not None:  # None: the pool is fragmented; fall through to disk
                    self.delete(key)
                    self._cpu[key] = (meta, stored)
                    return "cpu"
        self._write_disk(key, meta, tensors)
        if key in self._cpu:
            self.host.release(self._cpu.pop(key)[1])
        return "disk"

    def reserve(self, key: str, tensors: dict[str, torch.Tensor], keep=(), spare=(),
                demote: bool = True) -> dict[str, torch.Tensor] | None:
        """Views of the CPU tier's pool shaped as `tensors` (on any device), for an entry of `key` that
        the caller fills (a copy from the device straight into pinned memory) and then registers with
        put_reserved, or gives back with release_reserved. Makes room as put does (without `demote`,
        only by deleting `spare` entries: for a copy, which must not push a sole one out); None when
        the CPU tier cannot hold them (put them instead). Until then they count as used."""
        if self.host is None or HostPool.footprint(tensors) > self.host.capacity:
            return None
        self._make_cpu_room(HostPool.footprint(tensors), exclude={key, *keep}, spare=spare, demote=demote)
        return self.host.take_like(tensors)

    def put_reserved(self, key: str, meta: dict, views: dict[str, torch.Tensor]) -> str:
        """Register filled views from `reserve` as the CPU entry of `key` (replacing any entry of it)."""
        meta = {**meta, "payload_bytes": sum(t.numel() * t.element_size() for t in views.values())}
        self.delete(key)
        self._cpu[key] = (meta, views)
        return "cpu"

    def release_reserved(self, views: dict[str, torch.Tensor]) -> None:
        self.host.release(views)

    def get(self, key: str) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """(tier, meta, tensors) of an entry; disk reads are verified (CorruptStateError)."""
        if key in self._cpu:
            self._cpu.move_to_end(key)
            meta, tensors = self._cpu[key]
            return "cpu", meta, tensors
        if self.disk is None or key not in self.disk:
            raise KeyError(key)
        meta, tensors = self.disk.read(key)
        return "disk", meta, tensors

    def demote(self, key: str) -> None:
        """Move a CPU entry to disk (raises StateTiersFullError, keeping it on the CPU, if no room)."""
        meta, tensors = self._cpu[key]
        self._write_disk(key, meta, tensors)
        self.host.release(self._cpu.pop(key)[1])

    def delete(self, key: str) -> None:
        if key in self._cpu:
            self.host.release(self._cpu.pop(key)[1])
        if self.disk is not None and key in self.disk:
            self.disk.delete(key)

    # ---- internals --------------------------------------------------------------------------
    def _make_cpu_room(self, need: int, exclude: set[str], spare=(), demote: bool = True) -> None:
        """Free CPU-tier memory for `need` bytes: spare entries are deleted first (least recently
        used first), then, with demote, the others go to disk."""
        for key in [k for k in self._cpu if k in spare and k not in exclude]:
            if self.host.free_bytes() >= need:
                return
            self.delete(key)
        for key in list(self._cpu) if demote else ():
            if self.host.free_bytes() >= need:
                return
            if key not in exclude:
                self.demote(key)

    def _write_disk(self, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        if self.disk is None:
            raise StateTiersFullError(
                f"no room to store conversation {key}: the CPU tier is full or too small and there is no disk "
                f"tier; give LLM(state_cpu_memory=...) more memory or a state_disk_dir")
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.disk_bytes is not None:
            others = self.disk.bytes_used() - (self.disk.entry_bytes(key) if key in self.disk else 0)
            if others + payload > self.disk_bytes:
                raise StateTiersFullError(
                    f"no room to store conversation {key} ({payload} bytes): the disk tier holds {others} of "
                    f"{self.disk_bytes} bytes and the CPU tier is full; nothing was dropped. Close conversations "
                    f"or raise state_disk_memory")
        self.disk.write(key, tensors, {**meta, "last_used": time.time()})
