"""The model the SequenceKV tests check against: what each (layer, KV head) of a sequence should hold,
and helpers that append random K/V, compare a sequence and its pool with the model, and snapshot
both to show that a failed operation changed nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV

PS, D = 4, 8


# ---- helpers ----------------------------------------------------------------------------------

class Expected:
    """What each (layer, head) of one sequence should hold, in order: K rows, V rows, positions."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        L, H = pool.num_layers, pool.num_kv_heads
        self.k = [[torch.zeros(0, pool.head_dim, dtype=pool.dtype) for _ in range(H)] for _ in range(L)]
        self.v = [[torch.zeros(0, pool.head_dim, dtype=pool.dtype) for _ in range(H)] for _ in range(L)]
        self.pos = [[torch.zeros(0, dtype=torch.int64) for _ in range(H)] for _ in range(L)]
        self.next_position = 0

    def lengths(self) -> np.ndarray:
        return np.array([[len(p) for p in layer] for layer in self.pos], dtype=np.int64)

    def append(self, k, v):  # k, v [L, H, T, D]
        T = k.shape[2]
        new_pos = torch.arange(self.next_position, self.next_position + T)
        for layer in range(len(self.k)):
            for head in range(len(self.k[layer])):
                self.k[layer][head] = torch.cat([self.k[layer][head], k[layer, head]])
                self.v[layer][head] = torch.cat([self.v[layer][head], v[layer, head]])
                self.pos[layer][head] = torch.cat([self.pos[layer][head], new_pos])
        self.next_position += T

    def keep(self, layer, indices):
        for head, idx in enumerate(indices):
            idx = torch.as_tensor(idx, dtype=torch.int64).sort().values
            self.k[layer][head] = self.k[layer][head][idx]
            self.v[layer][head] = self.v[layer][head][idx]
            self.pos[layer][head] = self.pos[layer][head][idx]

    def truncate(self, n):
        if n >= self.next_position:
            return
        for layer in range(len(self.k)):
            for head in range(len(self.k[layer])):
                sel = self.pos[layer][head] < n
                self.k[layer][head] = self.k[layer][head][sel]
                self.v[layer][head] = self.v[layer][head][sel]
                self.pos[layer][head] = self.pos[layer][head][sel]
        self.next_position = n

    def free(self):
        self.__init__(self.pool)


def make_pool(layers=2, heads=2, num_pages=16, page_size=PS, head_dim=D, dtype=torch.float32, device="cpu"):
    return PagePool(layers, heads, head_dim, num_pages, page_size, dtype=dtype, device=device)


def append(seq: SequenceKV, expected: Expected, T: int, gen: torch.Generator):
    """Reserve T tokens, write random K/V in the slots layout [L, H, T] (head, token order per layer)."""
    pool = seq.pool
    L, H = pool.num_layers, pool.num_kv_heads
    k = torch.randn(L, H, T, pool.head_dim, generator=gen).to(pool.dtype)
    v = torch.randn(L, H, T, pool.head_dim, generator=gen).to(pool.dtype)
    slots = seq.reserve(T)
    assert slots.shape == (L, H, T) and slots.dtype == torch.int64 and slots.device.type == pool.device.type
    for layer in range(L):
        pool.write(layer, slots[layer].reshape(-1), k[layer].reshape(-1, pool.head_dim).to(pool.device),
                   v[layer].reshape(-1, pool.head_dim).to(pool.device))
    expected.append(k, v)
    return slots, k, v


def check(seq: SequenceKV, expected: Expected):
    """Gathered K/V/positions, lengths, pages and next_position match the model exactly."""
    pool = seq.pool
    ps = pool.page_size
    lengths = expected.lengths()
    np.testing.assert_array_equal(seq.lengths, lengths)
    np.testing.assert_array_equal(seq.num_pages, -(-lengths // ps))
    assert seq.next_position == expected.next_position
    assert seq.tokens() == int(lengths.sum())
    # the (possibly device-side, lazily refreshed) table agrees with the host table where it is used
    table = seq.device_table().cpu()
    for layer in range(pool.num_layers):
        for head in range(pool.num_kv_heads):
            n = seq.num_pages[layer, head]
            assert table[layer, head, :n].tolist() == seq.table[layer, head, :n].tolist()
        k, v, pos = (t.cpu() for t in seq.gather(layer))
        S = int(lengths[layer].max(initial=0))
        assert k.shape == (pool.num_kv_heads, S, pool.head_dim) and v.shape == k.shape
        assert pos.shape == (pool.num_kv_heads, S)
        for head in range(pool.num_kv_heads):
            n = lengths[layer, head]
            assert seq.num_pages[layer, head] == math.ceil(n / ps)
            assert torch.equal(k[head, :n], expected.k[layer][head]), (layer, head)
            assert torch.equal(v[head, :n], expected.v[layer][head]), (layer, head)
            assert torch.equal(pos[head, :n], expected.pos[layer][head]), (layer, head)
            # positions ascend strictly and stay below the uncompressed count
            if n:
                assert bool((pos[head, 1:n] > pos[head, : n - 1]).all())
                assert int(pos[head, n - 1]) < seq.next_position


def owned_pages(seq: SequenceKV, layer: int) -> list[int]:
    return [int(p) for head in range(seq.pool.num_kv_heads)
            for p in seq.table[layer, head, : seq.num_pages[layer, head]]]


def check_pool(pool: PagePool, seqs: list[SequenceKV]):
    """Pages are owned by at most one (sequence, head), the free list is the rest, bytes add up."""
    for layer in range(pool.num_layers):
        owned = [p for s in seqs for p in owned_pages(s, layer)]
        assert len(owned) == len(set(owned)), f"layer {layer}: a page is owned twice: {sorted(owned)}"
        assert all(0 <= p < pool.num_pages for p in owned)
        assert len(owned) + pool.free_pages(layer) == pool.num_pages
        assert pool.used_pages(layer) == len(owned)
        # the free pages are exactly the ones nobody owns (allocate + release restores the stack)
        free = pool.allocate([pool.free_pages(l) if l == layer else 0 for l in range(pool.num_layers)])[layer]
        pool.release(layer, free)
        assert sorted(free.tolist() + owned) == list(range(pool.num_pages))
    assert pool.bytes_in_use() == sum(s.bytes() for s in seqs)


def snapshot(seq: SequenceKV):
    return dict(
        lengths=seq.lengths.copy(),
        num_pages=seq.num_pages.copy(),
        next_position=seq.next_position,
        tables=[[seq.table[l, h, : seq.num_pages[l, h]].copy() for h in range(seq.pool.num_kv_heads)]
                for l in range(seq.pool.num_layers)],
        gathered=[tuple(t.clone() for t in seq.gather(l)) for l in range(seq.pool.num_layers)],
        bytes=seq.bytes(),
    )


def pool_snapshot(pool: PagePool):
    return dict(free=[pool.free_pages(l) for l in range(pool.num_layers)], k=pool.k.clone(), v=pool.v.clone(),
                positions=pool.positions.clone(), bytes=pool.bytes_in_use())


def assert_same(a, b):
    np.testing.assert_array_equal(a["lengths"], b["lengths"])
    np.testing.assert_array_equal(a["num_pages"], b["num_pages"])
    assert a["next_position"] == b["next_position"]
    assert a["bytes"] == b["bytes"]
    for ta, tb in zip(a["tables"], b["tables"]):
        for ha, hb in zip(ta, tb):
            np.testing.assert_array_equal(ha, hb)
    for ga, gb in zip(a["gathered"], b["gathered"]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


def assert_pool_same(a, b):
    assert a["free"] == b["free"]
    assert a["bytes"] == b["bytes"]
    for key in ("k", "v", "positions"):
        assert torch.equal(a[key], b[key]), key


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
