"""The observation window: steps handed in for all layers at once read back exactly as per-layer
records, across flushes, truncation and snapshots."""

from __future__ import annotations

import torch

from turnkv.methods import window
from turnkv.methods.window import QueryWindow


def _steps(n, L=3, Hq=4, D=8, start=0):
    g = torch.Generator().manual_seed(start)
    return [(torch.randn(L, 1, Hq, D, generator=g), torch.tensor([start + i])) for i in range(n)]


def test_record_all_equals_per_layer_records_across_flushes(monkeypatch):
    monkeypatch.setattr(window, "FLUSH_EVERY", 4)  # several flushes in 11 steps
    lazy, eager = QueryWindow(3, 6), QueryWindow(3, 6)
    prefill = torch.randn(3, 5, 4, 8)
    for layer in range(3):
        lazy.record(layer, prefill[layer], torch.arange(5))
        eager.record(layer, prefill[layer], torch.arange(5))
    for q, pos in _steps(11, start=5):
        lazy.record_all(q, pos)
        for layer in range(3):
            eager.record(layer, q[layer], pos)
    assert len(lazy._pending) == 3  # 11 steps: two flushes of 4, three still pending
    for layer in range(3):
        torch.testing.assert_close(lazy.queries[layer], eager.queries[layer], rtol=0, atol=0)
        assert lazy.positions[layer].tolist() == list(range(10, 16))
    assert not lazy._pending


def test_truncate_and_snapshot_see_pending_steps():
    w = QueryWindow(2, 8)
    for q, pos in _steps(5, L=2):
        w.record_all(q, pos)
    snap = w.snapshot()
    assert snap[1][0].tolist() == [0, 1, 2, 3, 4]
    w.truncate(3)
    assert w.positions[1].tolist() == [0, 1, 2]
    for q, pos in _steps(2, L=2, start=3):
        w.record_all(q, pos)
    w.restore(snap)  # pending steps after the snapshot are dropped with it
    assert w.positions[0].tolist() == [0, 1, 2, 3, 4]
