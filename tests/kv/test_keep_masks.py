"""SequenceKV.keep_masks (eviction's compaction of several layers in one pass) and the multi-layer
reads beside it (gather_layers, gather_positions, PagePool.move over several layers), each checked
against the independent model of tests/kv/conftest.py or against the one-layer path."""

from __future__ import annotations

import pytest
import torch

from tests.kv.conftest import (
    PS,
    D,
    Expected,
    append,
    assert_pool_same,
    assert_same,
    check,
    check_pool,
    make_pool,
    pool_snapshot,
    snapshot,
)
from turnkv.kv import compaction, quant
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV

UNEVEN = [[list(range(0, 14, 2)), list(range(14)), list(range(3, 12))],  # heads of 7, 14, 9 tokens
          [list(range(14)), list(range(5)), list(range(1, 14, 3))],
          [list(range(2, 14)), list(range(0, 14, 4)), list(range(14))]]


def uneven(gen, layers=3, heads=3, num_pages=48):
    """A sequence of 14 tokens whose heads then kept different tokens in every layer, and its model."""
    pool = make_pool(layers=layers, heads=heads, num_pages=num_pages)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 14, gen)
    for layer in range(layers):
        seq.keep(layer, UNEVEN[layer])
        exp.keep(layer, UNEVEN[layer])
    return pool, seq, exp


def random_masks(seq, layers, S, gen):
    masks = torch.rand(len(layers), seq.pool.num_kv_heads, S, generator=gen) < 0.5
    masks[:, 1, :5] = True  # a kept prefix: those tokens stay where they are
    return masks & seq.held(layers, S, masks.device)


@pytest.mark.parametrize("move_slots", [1 << 20, 3], ids=["one-move", "moves-of-3-tokens"])
@pytest.mark.parametrize("layers", [[0, 1, 2], [2, 0], [1]])
def test_keep_masks_keeps_the_marked_tokens_of_every_layer_in_one_move(gen, layers, move_slots, monkeypatch):
    monkeypatch.setattr(compaction, "MOVE_SLOTS", move_slots)
    pool, seq, exp = uneven(gen)
    S = int(seq.lengths[layers].max()) + 3  # wider than the longest head: the padding is not kept
    masks = random_masks(seq, layers, S, gen)
    moves = []
    move = PagePool.move
    monkeypatch.setattr(PagePool, "move", lambda self, *args: moves.append(args) or move(self, *args))
    seq.keep_masks(layers, masks)
    moved = sum(len(args[1]) for args in moves)
    assert moved > 3 and len(moves) == (1 if move_slots > moved else -(-moved // move_slots))
    for g, layer in enumerate(layers):
        exp.keep(layer, [masks[g, h].nonzero().flatten() for h in range(3)])
        assert seq.lengths[layer].tolist() == masks[g].sum(dim=1).tolist()
    check(seq, exp)
    check_pool(pool, [seq])


def test_keep_masks_over_shared_pages_copies_them_and_leaves_the_other_holder_intact(gen):
    pool = make_pool(layers=2, heads=2, num_pages=40)
    a, exp_a = SequenceKV(pool), Expected(pool)
    append(a, exp_a, 12, gen)
    b = SequenceKV(pool)
    b.share_from(a)
    exp_b = Expected(pool)
    exp_b.k, exp_b.v = [[t.clone() for t in h] for h in exp_a.k], [[t.clone() for t in h] for h in exp_a.v]
    exp_b.pos, exp_b.next_position = [[t.clone() for t in h] for h in exp_a.pos], exp_a.next_position
    masks = torch.ones(2, 2, 12, dtype=torch.bool)
    masks[0, 0, 4:8] = False  # layer 0 head 0 drops its second page's tokens
    masks[1, 1, 9] = False  # layer 1 head 1 drops one token of its last page
    b.keep_masks([0, 1], masks)
    for layer in range(2):
        exp_b.keep(layer, [masks[layer, h].nonzero().flatten() for h in range(2)])
    check(a, exp_a)
    check(b, exp_b)
    # Only the pages a compaction wrote were copied.
    assert b.table[0, 0, 0] == a.table[0, 0, 0] and b.table[0, 0, 1] != a.table[0, 0, 1]
    assert (b.table[0, 1, :3] == a.table[0, 1, :3]).all() and (b.table[1, 1, :2] == a.table[1, 1, :2]).all()
    assert b.table[1, 1, 2] != a.table[1, 1, 2]


@pytest.mark.parametrize("layers, bad", [
    pytest.param([0], torch.ones(1, 3, 15, dtype=torch.bool), id="past-the-heads-length"),
    pytest.param([0, 1], torch.ones(2, 3, 13, dtype=torch.bool), id="shorter-than-the-longest-head"),
    pytest.param([0, 1], torch.zeros(1, 3, 14, dtype=torch.bool), id="one-mask-for-two-layers"),
    pytest.param([0, 0], torch.zeros(2, 3, 14, dtype=torch.bool), id="a-layer-twice"),
    pytest.param([0], torch.zeros(1, 3, 14, dtype=torch.int64), id="not-bool"),
    pytest.param([0], torch.zeros(3, 14, dtype=torch.bool), id="no-layer-dimension"),
])
def test_keep_masks_rejects_a_bad_mask_without_changing_anything(gen, layers, bad):
    pool, seq, exp = uneven(gen)
    if bad.dtype == torch.bool and bad.dim() == 3 and bad.shape[0] == len(layers) and bad.shape[-1] == 15:
        bad = bad & (torch.arange(15) < 14)  # the mask is long enough, but marks entries past head 0's 7
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    with pytest.raises(ValueError, match="keep_masks"):
        seq.keep_masks(layers, bad)
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))
    check(seq, exp)


def test_keep_masks_of_an_empty_sequence_keeps_nothing_and_moves_nothing():
    pool = make_pool(layers=2, heads=2)
    seq = SequenceKV(pool)
    seq.keep_masks([0, 1], torch.zeros(2, 2, 0, dtype=torch.bool))
    assert seq.lengths.tolist() == [[0, 0], [0, 0]] and pool.bytes_in_use() == 0


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_gather_layers_is_every_layers_gather_padded_to_the_longest_head(gen, kv_dtype):
    pool = PagePool(3, 3, D, 48, PS, kv_dtype=kv_dtype)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 14, gen)
    for layer in range(3):
        seq.keep(layer, UNEVEN[layer])
    layers = [2, 0]
    k, v, pos = seq.gather_layers(layers)
    S = int(seq.lengths[layers].max())
    assert k.shape == v.shape == (2, 3, S, D) and pos.shape == (2, 3, S)
    assert torch.equal(seq.gather_positions(layers), pos)
    for g, layer in enumerate(layers):
        k1, v1, pos1 = seq.gather(layer)
        n = pos1.shape[1]
        held = seq.held([layer], n, pos1.device)[0]
        assert torch.equal(k[g, :, :n][held], k1[held]) and torch.equal(v[g, :, :n][held], v1[held])
        assert torch.equal(pos[g, :, :n][held], pos1[held])
        assert not seq.held([layer], S, pos.device)[0, :, n:].any()


def test_move_over_several_layers_equals_one_move_per_layer(gen):
    pools = [PagePool(2, 1, D, 4, PS, kv_dtype="int8") for _ in range(2)]
    for pool in pools:
        for layer in range(2):
            rows = torch.randn(4 * PS, D, generator=torch.Generator().manual_seed(layer))
            pool.write(layer, torch.arange(4 * PS), rows, -rows)
            pool.positions[layer].view(-1).copy_(torch.arange(4 * PS) + 100 * layer)
    src, dst = torch.tensor([5, 6, 9]), torch.tensor([1, 2, 3])
    pools[0].move(torch.tensor([0, 0, 1]), src, dst)
    pools[1].move(0, src[:2], dst[:2])
    pools[1].move(1, src[2:], dst[2:])
    for a, b in ((pools[0].k, pools[1].k), (pools[0].k_scale, pools[1].k_scale), (pools[0].v, pools[1].v),
                 (pools[0].positions, pools[1].positions)):
        assert torch.equal(quant.raw(a), quant.raw(b))
    assert pools[0].positions[1].view(-1)[3] == 109 and pools[0].positions[0].view(-1)[1] == 5
