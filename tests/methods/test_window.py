"""The observation window: steps handed in for all layers at once read back exactly as per-layer
records, across flushes, truncation and snapshots."""

from __future__ import annotations

import pytest
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_and_eager_steps_file_together():
    """Graphed decode steps hand their positions in from the host, eager ones (a mixed step) on the
    device: one flush files both, in order."""
    lazy, eager = QueryWindow(3, 6), QueryWindow(3, 6)
    for i, (q, pos) in enumerate(_steps(7)):
        q = q.cuda()
        lazy.record_all(q, pos if i % 2 else pos.cuda())
        for layer in range(3):
            eager.record(layer, q[layer], pos.cuda())
    for layer in range(3):
        torch.testing.assert_close(lazy.queries[layer], eager.queries[layer], rtol=0, atol=0)
        assert lazy.positions[layer].tolist() == eager.positions[layer].tolist() == [1, 2, 3, 4, 5, 6]


def test_moments_read_through_a_window_see_its_pending_steps():
    from turnkv.methods.window import QueryMoments

    lazy, eager = QueryWindow(3, 2), QueryWindow(3, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    lazy.moments, eager.moments = QueryMoments(3, inv_freq), QueryMoments(3, inv_freq)
    moments = lazy.moments  # held before the steps, read after them
    for q, pos in _steps(5):
        lazy.record_all(q, pos)
        for layer in range(3):
            eager.record(layer, q[layer], pos)
    for layer in range(3):
        for a, b in zip(moments.layer(layer), eager.moments.layer(layer)):
            torch.testing.assert_close(a, b)
