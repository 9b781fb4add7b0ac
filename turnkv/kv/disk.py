"""The disk tier: one safetensors file per stored conversation and a small JSON manifest beside it.

Crash safety comes from ordering, not locks. A write puts the tensors in a new file under a temporary
name, fsyncs it, renames it into place, then does the same for the manifest, which names the
tensors file and the SHA-256 of each of its 64 MiB chunks. The manifest rename is the commit point: a process killed at any
moment leaves either the old manifest (whose tensors file is still there) or the new one. Files no
manifest names, and temporaries, are removed when the store is opened.

The manifest also carries the conversation's token history (and whatever else the caller puts in
it), so a tensors file found truncated or corrupt is not a lost conversation: it is recomputed.

Checksums per chunk, hashed on a thread pool (hashlib releases the GIL on large buffers): one SHA-256
over a 32K-token 8B state (4.3 GB) took seconds on one core, most of a restart's restore on the GPU
machine. Manifests written with one whole-file "sha256" (format 1) are still read.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from turnkv.errors import TurnkvError

FORMAT = 2
CHUNK = 64 << 20  # bytes per checksum


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
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sweep()

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
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CorruptStateError(f"stored state {key}: {path.name} is missing") from None
        if len(data) != meta["nbytes"] or not _digests_match(data, meta):
            raise CorruptStateError(f"stored state {key}: {path.name} is truncated or corrupt "
                                    f"({len(data)} bytes, expected {meta['nbytes']} with a matching SHA-256)")
        return meta, st_load(data)

    def delete(self, key: str) -> None:
        tensors = self._tensors_file(key)
        self._manifest_path(key).unlink(missing_ok=True)
        if tensors is not None:
            (self.dir / tensors).unlink(missing_ok=True)
        _fsync_dir(self.dir)

    # ---- internals --------------------------------------------------------------------------
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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digests_match(data: bytes, meta: dict) -> bool:
    if "sha256_chunks" in meta:
        return chunk_digests(data, int(meta["chunk_bytes"])) == meta["sha256_chunks"]
    return hashlib.sha256(data).hexdigest() == meta.get("sha256")  # format 1
