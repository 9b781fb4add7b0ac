"""The state tiers: exact export/import of a SequenceKV (uneven heads, positions, masses), the pinned
host pool, the crash-safe disk store, and LRU demotion with a clear error when every tier is full."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from turnkv.kv.disk import CorruptStateError, DiskStore
from turnkv.kv.host_pool import HostPool
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.snapshot import export_kv, import_kv
from turnkv.kv.tiers import StateTiersFullError, TieredStore


def evicted_sequence(pool: PagePool, tokens: int = 37, seed: int = 0) -> SequenceKV:
    """A sequence with random K/V and masses whose heads then kept different tokens."""
    gen = torch.Generator().manual_seed(seed)
    seq = SequenceKV(pool)
    L, H, D = pool.num_layers, pool.num_kv_heads, pool.head_dim
    slots = seq.reserve(tokens)
    for layer in range(L):
        s = slots[layer].reshape(-1)
        pool.write(layer, s, torch.randn(len(s), D, generator=gen), torch.randn(len(s), D, generator=gen))
        pool.attention_mass[layer].view(-1).index_copy_(0, s, torch.rand(len(s), generator=gen))
    for layer in range(L):
        keep = [torch.randperm(tokens, generator=gen)[: 5 + 7 * h + layer] for h in range(H)]
        seq.keep(layer, keep)
    return seq


def contents(seq: SequenceKV):
    out = []
    for layer in range(seq.pool.num_layers):
        k, v, pos = seq.gather(layer)
        mass = seq.gather_attention_mass(layer)
        for h, n in enumerate(seq.lengths[layer]):
            out.append((k[h, :n].clone(), v[h, :n].clone(), pos[h, :n].clone(), mass[h, :n].clone()))
    return out


def test_export_import_keeps_uneven_heads_positions_and_masses_exactly():
    pool = PagePool(3, 2, 8, num_pages=64, page_size=4)
    seq = evicted_sequence(pool)
    assert len(set(seq.lengths.flatten().tolist())) > 1  # uneven heads
    before, lengths, nbytes = contents(seq), seq.lengths.copy(), seq.bytes()
    meta, tensors = export_kv(seq)
    seq.free()
    assert pool.bytes_in_use() == 0
    restored = SequenceKV(pool)
    import_kv(restored, meta, tensors)
    assert (restored.lengths == lengths).all() and restored.next_position == 37 and restored.bytes() == nbytes
    for a, b in zip(before, contents(restored)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # Exported bytes: K and V rows of every held token, int64 positions (not contiguous), fp32 masses.
    held = int(lengths.sum())
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == held * (2 * 8 * 4 + 8 + 4)


def test_host_pool_is_all_or_nothing_and_coalesces():
    pool = HostPool(8 * 512, pin=False)
    a = pool.store({"x": torch.arange(256, dtype=torch.float32)})  # 1024 bytes -> 2 blocks
    b = pool.store({"y": torch.ones(3 * 128)})  # 3 blocks
    assert torch.equal(a["x"], torch.arange(256, dtype=torch.float32)) and pool.used == 5 * 512
    assert pool.store({"p": torch.ones(128), "q": torch.ones(3 * 128)}) is None  # needs 4, 3 free
    assert pool.used == 5 * 512  # the failed store took nothing
    pool.release(a)
    pool.release(b)
    assert pool.used == 0 and pool._free == [(0, pool.capacity)]
    whole = pool.store({"z": torch.zeros(pool.capacity // 4)})
    assert whole is not None and pool.free_bytes() == 0


def test_a_reserved_entry_is_filled_in_place_then_registered_or_given_back(tmp_path):
    """reserve -> views of the pool (counted as used, making room as put does) -> put_reserved
    registers them as the entry, without a copy; release_reserved gives them back."""
    tiers = TieredStore(4 * 512, disk_dir=tmp_path)
    old = {"k": torch.arange(64, dtype=torch.float32)}  # 256 bytes: one extent
    tiers.put("old", {}, old)
    tensors = {"k": torch.ones(2, 64), "v": torch.ones(64, dtype=torch.float16)}  # 512 + 128 bytes: two extents
    views = tiers.reserve("new", tensors)
    assert {n: (v.shape, v.dtype) for n, v in views.items()} == {n: (t.shape, t.dtype) for n, t in tensors.items()}
    assert tiers.host.used == 3 * 512 and tiers.tier_of("new") is None
    for name, t in tensors.items():
        views[name].copy_(t)
    assert tiers.put_reserved("new", {"m": 1}, views) == "cpu"
    tier, meta, got = tiers.get("new")
    assert tier == "cpu" and meta == {"m": 1, "payload_bytes": 640}
    assert all(got[n].data_ptr() == views[n].data_ptr() and torch.equal(got[n], tensors[n]) for n in tensors)
    # A reservation the pool can only hold by demoting "old" (the whole pool) moves it to disk.
    tiers.delete("new")
    spare = tiers.reserve("big", {"x": torch.empty(4 * 512, dtype=torch.uint8)})
    assert spare is not None and tiers.tier_of("old") == "disk" and tiers.host.used == 4 * 512
    tiers.release_reserved(spare)
    assert tiers.host.used == 0
    assert tiers.reserve("huge", {"x": torch.empty(5 * 512, dtype=torch.uint8)}) is None  # over the capacity


def test_a_host_pool_the_driver_cannot_pin_falls_back_to_pageable_memory(monkeypatch, caplog):
    """Pinning more host memory than the driver allows fails (a CUDA out-of-memory error): the CPU
    tier then works from pageable memory and says so, instead of failing every offload."""
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with caplog.at_level("WARNING", logger="turnkv.kv"):
        pool = HostPool(8 * 512, pin=True)
    assert not pool.pinned and not pool.buffer.is_pinned() and pool.capacity == 8 * 512
    assert "could not pin" in caplog.text and "pageable" in caplog.text
    stored = pool.store({"x": torch.arange(16.0)})
    assert torch.equal(stored["x"], torch.arange(16.0))
    with pytest.raises(RuntimeError):  # an unpinned allocation that fails is not hidden
        monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("host OOM")))
        HostPool(8 * 512, pin=False)


def test_disk_store_survives_reopening_and_detects_corruption(tmp_path):
    tensors = {"k.0": torch.randn(5, 4).to(torch.bfloat16), "pos.0": torch.arange(5)}
    DiskStore(tmp_path).write("conv1", tensors, {"tokens": [1, 2, 3]})
    store = DiskStore(tmp_path)  # a restarted process
    assert store.ids() == ["conv1"]
    meta, back = store.read("conv1")
    assert meta["tokens"] == [1, 2, 3] and all(torch.equal(back[k], tensors[k]) for k in tensors)
    path = tmp_path / meta["tensors_file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="corrupt"):
        store.read("conv1")
    path.write_bytes(bytes(data[:20]))  # truncated
    with pytest.raises(CorruptStateError):
        store.read("conv1")
    assert store.manifest("conv1")["tokens"] == [1, 2, 3]  # the history survives for a recompute


def test_disk_checksums_per_chunk_catch_a_flip_in_any_chunk(tmp_path, monkeypatch):
    from turnkv.kv import disk

    monkeypatch.setattr(disk, "CHUNK", 1024)  # several chunks from a small entry
    tensors = {"x": torch.arange(2000, dtype=torch.float32)}
    store = DiskStore(tmp_path)
    store.write("c", tensors, {})
    meta = store.manifest("c")
    assert meta["format"] == 2 and len(meta["sha256_chunks"]) == -(-meta["nbytes"] // 1024) > 4
    path = tmp_path / meta["tensors_file"]
    clean = path.read_bytes()
    for offset in (100, 1024 * 3 + 7, len(clean) - 1):  # first, a middle and the last chunk
        data = bytearray(clean)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptStateError, match="corrupt"):
            store.read("c")
    path.write_bytes(clean)
    assert torch.equal(store.read("c")[1]["x"], tensors["x"])


def test_format_1_manifests_with_one_checksum_are_still_read(tmp_path):
    import hashlib
    import json

    store = DiskStore(tmp_path)
    store.write("old", {"x": torch.ones(3)}, {"tokens": [5]})
    manifest = tmp_path / "old.json"
    meta = json.loads(manifest.read_text())
    data = (tmp_path / meta["tensors_file"]).read_bytes()
    for key in ("chunk_bytes", "sha256_chunks"):
        del meta[key]
    meta.update(format=1, sha256=hashlib.sha256(data).hexdigest())
    manifest.write_text(json.dumps(meta))
    assert torch.equal(DiskStore(tmp_path).read("old")[1]["x"], torch.ones(3))
    meta["sha256"] = "0" * 64
    manifest.write_text(json.dumps(meta))
    with pytest.raises(CorruptStateError):
        DiskStore(tmp_path).read("old")


def test_read_gives_views_of_one_buffer_that_outlive_the_store(tmp_path, monkeypatch):
    import gc

    from turnkv.kv import disk

    monkeypatch.setattr(disk, "CHUNK", 4096)  # read and hashed in many chunks, in parallel
    tensors = {"k": torch.randn(300, 16).to(torch.bfloat16), "scale": torch.rand(300), "codes": torch.randint(-128, 127, (301,), dtype=torch.int8),
               "pos": torch.arange(300), "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4), "one": torch.tensor(2.5)}
    DiskStore(tmp_path).write("c", tensors, {})
    _, back = DiskStore(tmp_path).read("c")
    gc.collect()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    # Views: no tensor owns a copy (the pool's restore copies them to the device once).
    bases = {back[n].untyped_storage().data_ptr() for n in ("k", "scale", "pos")}
    assert len(bases) == 1


def test_misaligned_tensors_in_a_foreign_file_are_copied_to_alignment():
    import json
    import struct

    from turnkv.kv import disk

    x = torch.arange(3, dtype=torch.float32)
    header = json.dumps({"b": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
                         "x": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytearray(struct.pack("<Q", len(header)) + header + bytes([1, 2, 3]) + x.numpy().tobytes())
    out = disk._tensors_in(data)
    assert torch.equal(out["b"], torch.tensor([1, 2, 3], dtype=torch.int8)) and torch.equal(out["x"], x)


def test_the_read_rate_is_measured_and_kept_for_the_next_process(tmp_path):
    store = DiskStore(tmp_path)
    assert store.read_rate is None
    store.write("small", {"x": torch.ones(10)}, {})
    store.read("small")
    assert store.read_rate is None  # under 1 MiB: overheads, not the disk
    store.write("big", {"x": torch.ones(1 << 19)}, {})  # 2 MiB
    store.read("big")
    assert store.read_rate is not None and store.read_rate > 1e6
    again = DiskStore(tmp_path)
    assert again.read_rate == store.read_rate and again.ids() == ["big", "small"]


WRITER = textwrap.dedent("""
    import sys, torch
    from turnkv.kv.disk import DiskStore
    store = DiskStore(sys.argv[1])
    i = 0
    print("ready", flush=True)
    while True:
        i += 1
        store.write(f"c{i % 3}", {"x": torch.full((1 << 20,), float(i))}, {"i": i})
""")


def _check_consistent(directory) -> int:
    store = DiskStore(directory)  # opening sweeps temporaries and unreferenced files
    for key in store.ids():
        meta, tensors = store.read(key)  # raises if a manifest names a torn file
        assert torch.all(tensors["x"] == float(meta["i"]))
    names = {p.name for p in directory.iterdir()}
    assert not any(n.endswith(".tmp") for n in names)
    assert len([n for n in names if n.endswith(".safetensors")]) == len(store.ids())
    return len(store.ids())


def _child_env():
    """The environment of a child Python: this checkout first, then whatever path the parent had."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def test_killing_the_writer_mid_write_leaves_a_consistent_store(tmp_path):
    env = _child_env()
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3 + 0.17 * attempt)  # writes of 4 MiB take a few ms: the kill lands inside one
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _check_consistent(tmp_path) >= 1


def test_a_crash_between_the_tensors_and_the_manifest_keeps_the_old_entry(tmp_path):
    store = DiskStore(tmp_path)
    store.write("c", {"x": torch.full((4,), 1.0)}, {"i": 1})
    script = textwrap.dedent(f"""
        import os, torch
        import turnkv.kv.disk as disk
        real = disk._atomic_write
        def crash_on_manifest(path, data):
            if path.suffix == ".json":
                os._exit(3)  # the new tensors file is in place; the commit point never comes
            real(path, data)
        disk._atomic_write = crash_on_manifest
        disk.DiskStore({str(tmp_path)!r}).write("c", {{"x": torch.full((4,), 2.0)}}, {{"i": 2}})
    """)
    result = subprocess.run([sys.executable, "-c", script], env=_child_env())
    assert result.returncode == 3
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # the orphan is there until the next open
    assert _check_consistent(tmp_path) == 1
    meta, tensors = DiskStore(tmp_path).read("c")
    assert meta["i"] == 1 and torch.all(tensors["x"] == 1.0)


def entry(value: float, n: int = 256) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n,), value)}


def test_lru_demotion_to_disk_and_full_tiers_error_keeps_everything(tmp_path):
    # Two entries fit each tier (an entry on disk is its 1 KiB plus a header and a manifest).
    store = TieredStore(cpu_bytes=2 * 1024, disk_dir=tmp_path, disk_bytes=2 * 1500, pin=False)
    assert store.put("a", {"n": 1}, entry(1.0)) == "cpu"
    assert store.put("b", {"n": 2}, entry(2.0)) == "cpu"
    store.get("a")  # a is now the most recently used
    assert store.put("c", {"n": 3}, entry(3.0)) == "cpu"
    assert store.tier_of("b") == "disk" and store.tier_of("a") == "cpu"  # LRU b went down
    assert store.put("d", {"n": 4}, entry(4.0)) == "cpu"
    assert store.tier_of("a") == "disk"
    with pytest.raises(StateTiersFullError, match="nothing was dropped"):
        store.put("e", {"n": 5}, entry(5.0))
    # Every entry is still somewhere, intact; "e" was not stored.
    for key, value in {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}.items():
        tier, meta, tensors = store.get(key)
        assert torch.all(tensors["x"] == value) and meta["n"] == int(value)
    assert store.tier_of("e") is None
    assert store.stored_bytes("a") == 1024 and store.stored_bytes("c") == 1024


def test_without_a_disk_tier_a_too_large_entry_is_refused():
    store = TieredStore(cpu_bytes=1024, pin=False)
    with pytest.raises(StateTiersFullError, match="no disk"):
        store.put("big", {}, entry(1.0, 1024))
    assert store.tier_of("big") is None and store.host.used == 0
