"""The disk tier: one safetensors file per stored conversation and a small JSON manifest beside it.

A write renames the fsynced tensors file, then the manifest (the commit point) into place, so a killed
writer leaves the old entry or the new one; unnamed files and temporaries are removed on open. The
manifest names the tensors file, the SHA-256 of each 64 MiB chunk (checked on read: CorruptStateError)
and the caller's data (the token history). Reads return views of one buffer, hashed as read; the store
keeps the observed `read_rate` (bytes/s). Manifests with one whole-file "sha256" (format 1) still read.
Design: docs/state.md#the-disk-tier"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from turnkv.errors import TurnkvError
from turnkv.paths import user_path

FORMAT = 2
CHUNK = 64 << 20  # bytes per checksum
RATE_FILE = "read_rate.txt"  # not .json: manifests are
# safetensors' dtype names (the file format's header), for tensors viewed in the read buffer.
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def chunk_digests(data: bytes | memoryview, chunk: int | None = None) -> list[str]:
    """SHA-256 of each chunk-byte slice of data (CHUNK by default), computed in parallel."""
    chunk = chunk or CHUNK
    view = memoryview(data)
    parts = [view[i : i + chunk] for i in range(0, len(view), chunk)] or [view]
    if len(parts) == 1:
        return [hashlib.sha256(parts[0]).hexdigest()]
    with ThreadPoolExecutor(max_workers=min(len(parts), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda part: hashlib.sha256(part).hexdigest(), parts))


class CorruptStateError(TurnkvError):
    """A stored state is truncated, corrupt or missing; its manifest (and token history) survived."""


class DiskStore:
    def __init__(self, directory: str | os.PathLike):
        self.dir = user_path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sweep()
        try:  # the read rate (bytes/s) an earlier process measured on this directory
            self.read_rate: float | None = float((self.dir / RATE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            self.read_rate = None

    # ---- queries ----------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(p.name[: -len(".json")] for p in self.dir.glob("*.json"))

    def __contains__(self, key: str) -> bool:
        return self._manifest_path(key).exists()

    def manifest(self, key: str) -> dict:
        try:
            return json.loads(self._manifest_path(key).read_text())
        except FileNotFoundError:
            raise KeyError(key) from None

    def bytes_used(self) -> int:
        return sum(self.entry_bytes(key) for key in self.ids())

    def entry_bytes(self, key: str) -> int:
        path = self._manifest_path(key)
        try:
            m = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return 0
        return path.stat().st_size + int(m.get("nbytes", 0))

    # ---- writes -----------------------------------------------------------------------------
    def write(self, key: str, tensors: dict[str, torch.Tensor], manifest: dict) -> int:
        """Store (or replace) an entry; returns the bytes it takes on disk."""
        _check_key(key)
        # safetensors refuses tensors that share a buffer (host-pool views do): give each its own.
        data = st_save({name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()})
        old = self._tensors_file(key)
        name = f"{key}.{uuid.uuid4().hex[:12]}.safetensors"
        _atomic_write(self.dir / name, data)
        meta = {**manifest, "format": FORMAT, "tensors_file": name, "nbytes": len(data),
                "chunk_bytes": CHUNK, "sha256_chunks": chunk_digests(data)}
        _atomic_write(self._manifest_path(key), json.dumps(meta).encode())
        if old is not None and old != name:
            (self.dir / old).unlink(missing_ok=True)
        return self.entry_bytes(key)

    def read(self, key: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """(manifest, tensors); CorruptStateError if the tensors file is missing, short or altered."""
        meta = self.manifest(key)
        path = self.dir / meta["tensors_file"]
        start = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptStateError(f"stored state {key}: {path.name} is missing") from None
        try:
            size = os.fstat(fd).st_size
            ok = size == meta["nbytes"]
            if ok:
                data = bytearray(size)
                chunk = int(meta.get("chunk_bytes", size or 1))
                try:
                    digests = _read_chunks(fd, memoryview(data), chunk)
                except CorruptStateError as e:  # shrank while being read
                    raise CorruptStateError(f"stored state {key}: {path.name}: {e}") from None
                # Format 1 has no chunk_bytes: one chunk, the whole-file digest.
                ok = digests == meta.get("sha256_chunks", [meta.get("sha256")])
        finally:
            os.close(fd)
        if not ok:
            raise CorruptStateError(f"stored state {key}: {path.name} is truncated or corrupt "
                                    f"({size} bytes, expected {meta['nbytes']} with a matching SHA-256)")
        try:
            tensors = _tensors_in(data)
        except (ValueError, KeyError, RuntimeError, struct.error) as e:
            raise CorruptStateError(f"stored state {key}: {path.name} is not a readable safetensors file: {e}") from None
        self._observe_rate(size, time.perf_counter() - start)
        return meta, tensors

    def delete(self, key: str) -> None:
        tensors = self._tensors_file(key)
        self._manifest_path(key).unlink(missing_ok=True)
        if tensors is not None:
            (self.dir / tensors).unlink(missing_ok=True)
        _fsync_dir(self.dir)

    # ---- internals --------------------------------------------------------------------------
    def _observe_rate(self, nbytes: int, seconds: float) -> None:
        """Fold one read into read_rate (reads under 1 MiB say more about overheads than the disk)."""
        if nbytes < (1 << 20) or seconds <= 0:
            return
        rate = nbytes / seconds
        self.read_rate = rate if self.read_rate is None else 0.5 * (self.read_rate + rate)
        try:
            _atomic_write(self.dir / RATE_FILE, repr(self.read_rate).encode(), sync=False)
        except OSError:
            pass  # a hint for the next process, not state

    def _manifest_path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def _tensors_file(self, key: str) -> str | None:
        try:
            return self.manifest(key)["tensors_file"]
        except (KeyError, json.JSONDecodeError):
            return None

    def _sweep(self) -> None:
        """Remove what a killed writer left: temporaries and tensors files no manifest names."""
        named = {self._tensors_file(key) for key in self.ids()}
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp") or (path.suffix == ".safetensors" and path.name not in named):
                path.unlink(missing_ok=True)


def _check_key(key: str) -> None:
    if not key or not all(c.isalnum() or c in "-_" for c in key):
        raise ValueError(f"a stored state's key must be letters, digits, - or _, not {key!r}")


def _atomic_write(path: Path, data: bytes, sync: bool = True) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_chunks(fd: int, into: memoryview, chunk: int) -> list[str]:
    """Fill `into` from the file, chunk by chunk on a thread pool; the SHA-256 of each chunk."""

    def read(offset: int) -> str:
        part = into[offset : offset + chunk]
        done = 0
        while done < len(part):
            n = os.preadv(fd, [part[done:]], offset + done)
            if n == 0:
                raise CorruptStateError("the file ended early")
            done += n
        return hashlib.sha256(part).hexdigest()

    offsets = list(range(0, len(into), chunk)) or [0]
    if len(offsets) == 1:
        return [read(0)]
    with ThreadPoolExecutor(max_workers=min(len(offsets), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(read, offsets))


def _tensors_in(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `data`, as views of it (safetensors.torch.load
    copies each one out). The file: 8 bytes of header length, a JSON header of name -> dtype, shape
    and [begin, end) offsets into the data after it."""
    (header_len,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(bytes(data[8 : 8 + header_len]))
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        part = raw[base + begin : base + end]
        if (base + begin) % dtype.itemsize:
            part = part.clone()  # a view of a wider dtype must start on its alignment
        out[name] = part.view(dtype).view(info["shape"])
    return out
