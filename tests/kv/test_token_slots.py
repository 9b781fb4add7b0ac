"""Flat slots of a sequence's tokens, per layer in (head, token) order, made in one pass without reading
the device back: equal to the slots read off the page table on the host, for uneven heads and any
choice of layers."""

import numpy as np
import pytest
import torch

from turnkv.kv.token_slots import layer_slots, token_runs


def _host_slots(table: np.ndarray, lengths: np.ndarray, ps: int, layer: int) -> np.ndarray:
    return np.concatenate([table[layer, h, np.arange(n) // ps] * ps + np.arange(n) % ps
                           for h, n in enumerate(lengths[layer])] or [np.zeros(0, np.int64)])


def test_token_runs_name_each_tokens_run_and_its_index():
    run, index = token_runs(np.array([2, 0, 3]), "cpu")
    assert run.tolist() == [0, 0, 2, 2, 2]
    assert index.tolist() == [0, 1, 0, 1, 2]
    run, index = token_runs(np.zeros(4, np.int64), None)
    assert run.numel() == 0 and index.numel() == 0


@pytest.mark.parametrize("layers", [None, [2], [3, 0]])
def test_layer_slots_equal_the_host_reading_of_the_table(layers):
    rng = np.random.default_rng(0)
    L, H, P, ps = 4, 3, 6, 4
    table = rng.permutation(L * H * P).reshape(L, H, P).astype(np.int64)
    lengths = rng.integers(0, P * ps + 1, size=(L, H))
    lengths[1] = 0  # a layer with nothing kept
    slots, index = layer_slots(torch.from_numpy(table), lengths, ps, layers)
    for i, layer in enumerate(range(L) if layers is None else layers):
        assert slots[i].tolist() == _host_slots(table, lengths, ps, layer).tolist()
        assert index[i].tolist() == np.concatenate([np.arange(n) for n in lengths[layer]]).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a synchronization is a device's")
def test_layer_slots_never_wait_for_the_device():
    rng = np.random.default_rng(1)
    table = torch.from_numpy(rng.permutation(2 * 8 * 64).reshape(2, 8, 64)).cuda()
    lengths = rng.integers(0, 64 * 16, size=(2, 8))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots, _ = layer_slots(table, lengths, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert slots[1].cpu().tolist() == _host_slots(table.cpu().numpy(), lengths, 16, 1).tolist()
