"""Restoration strategies on the state axis, end to end through Conversation: between turns the
state leaves the GPU tier, and the next turn restores it. Exact strategies must give the resident
run's tokens turn by turn; the lossy ones (krul, minicache) are exact when nothing is merged away,
and their stored bytes match what they say they keep."""

from __future__ import annotations

import pytest
import torch

import turnkv
from tests.state.conftest import LAYERS
from turnkv.kv.snapshot import layout_of
from turnkv.state import merge, schedule
from turnkv.state.schedule import CostModel

MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?", "Summarise both."]


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB")
    # Fixed costs instead of a calibration: recompute and load comparable, so the splits are mixed.
    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    llm.state.ctx.set_cost("disk", CostModel(2e-6, 1e-9, 5e8))
    return llm


def run(llm, recipe, offload=None, max_new_tokens=12):
    conv = llm.conversation(system="You are terse.", recipe=recipe)
    replies, locations = [], []
    for message in MESSAGES:
        replies.append(conv.send(message, max_new_tokens=max_new_tokens).token_ids)
        if offload:
            conv.offload(offload)
        locations.append(conv.location)
    return conv, replies, locations


@pytest.fixture(scope="module")
def resident(llm):
    conv, replies, locations = run(llm, None)
    assert locations == ["gpu"] * 4
    conv.close()
    return replies


@pytest.mark.parametrize("state", ["recompute", "load", "load(layerwise=false)", "partial",
                                   "partial(recompute_ratio=0.5)", "gpu"])
def test_exact_strategies_give_the_resident_tokens_turn_by_turn(llm, resident, state):
    conv, replies, locations = run(llm, f"state={state}", offload="cpu" if state == "gpu" else None)
    assert locations == ["cpu"] * 4  # the state really left the GPU between turns
    assert conv.kv.bytes() == 0
    assert replies == resident
    conv.close()
    assert llm.pool.bytes_in_use() == llm.prefix_cache_bytes() and llm.state.tiers.usage()["cpu_entries"] == 0


def full_kv_bytes(llm, n):
    c = llm.config
    return n * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4  # fp32 K and V


def test_stored_bytes_by_number(llm):
    c = llm.config
    row = c.head_dim * 4  # one fp32 row of K (or V) of one head
    conv, _, _ = run(llm, "state=load")
    n = conv.kv.next_position if conv.location == "gpu" else llm.state.tiers.meta(conv.id)["state"]["next_position"]
    assert llm.state.stored_bytes(conv) == full_kv_bytes(llm, n)
    conv.close()
    conv, _, _ = run(llm, "state=recompute")
    assert llm.state.stored_bytes(conv) == 0  # only the token history, kept beside it
    conv.close()
    conv, _, _ = run(llm, "state=partial(recompute_ratio=0.25)")
    meta = llm.state.tiers.meta(conv.id)["state"]
    n = meta["next_position"]
    assert meta["starts"] == [round(0.25 * n)] * LAYERS
    assert llm.state.stored_bytes(conv) == LAYERS * c.num_kv_heads * (n - round(0.25 * n)) * 2 * row
    conv.close()
    conv, _, _ = run(llm, "state=krul(ir_threshold=0,fallback=never,recompute_ratio=0.3)")
    meta = llm.state.tiers.meta(conv.id)["state"]
    n, starts, pairs, retained = meta["next_position"], meta["starts"], meta["pairs"], meta["retained"]
    assert len(pairs) == LAYERS // 4 + 1 and all(i > j for i, j in pairs)  # |S| >= N * r_l = 3 -> 2 pairs
    assert all(a >= b for a, b in zip(starts, starts[1:]))  # the pyramid never grows with depth
    paired = {layer for p in pairs for layer in p}
    H = c.num_kv_heads
    expected = sum(H * (n - starts[layer]) * 2 * row for layer in range(LAYERS) if layer not in paired)
    for i, j in pairs:
        rows = H * (n - starts[i])
        expected += rows * 2 * row + rows * 4 * 4  # one direction for K and V, four fp32 magnitudes
        for kind in ("k", "v"):
            r = retained[f"{i}.{j}.{kind}"]
            assert r == int(0.05 * rows)
            expected += r * (4 + 2 * row)  # int32 index, both layers' original rows
    assert llm.state.stored_bytes(conv) == expected
    # The scheduler's model of the stored bytes is exact (the retention cap binds), and so is meta's.
    assert schedule.stored_bytes(starts, n, pairs, H, c.head_dim, 4, 0.05) == expected == meta["stored_bytes"]
    assert meta["full_bytes"] == full_kv_bytes(llm, n)
    # The budget: no more than the uniform split at r_c would store.
    assert expected <= LAYERS * H * (n - round(0.3 * n)) * 2 * row
    conv.close()


@pytest.mark.parametrize("storage", [0.5, 0.3])
def test_storage_knob_bounds_the_stored_bytes(llm, storage):
    """krul(storage=s) stores at most s of the full KV, by number, whatever r_c says: the pyramid
    recomputes what it must (tokens recomputed are not stored)."""
    conv, _, _ = run(llm, f"state=krul(ir_threshold=0,fallback=never,recompute_ratio=0.05,storage={storage})")
    meta = llm.state.tiers.meta(conv.id)["state"]
    n, starts = meta["next_position"], meta["starts"]
    full = full_kv_bytes(llm, n)
    stored = llm.state.stored_bytes(conv)
    assert stored == meta["stored_bytes"] and meta["full_bytes"] == full
    assert 0 < stored <= storage * full
    assert all(a >= b for a, b in zip(starts, starts[1:]))
    # r_c alone (0.05) would recompute 5%: the knob made the pyramid recompute more.
    assert meta["recompute_share"] > 0.05
    conv.close()


def test_storage_knob_with_every_row_retained_restores_the_resident_state(llm, resident):
    """Half the storage via a deep pyramid plus merged pairs, every merged row retained: lossless,
    so the replies are the resident ones (the pyramid recompute, the merge and the loads together)."""
    conv, replies, _ = run(llm, "state=krul(ir_threshold=0,fallback=never,storage=0.5,retain_threshold=-1,max_retained=1)")
    meta = llm.state.tiers.meta(conv.id)["state"]
    assert meta["pairs"] and meta["stored_bytes"] <= 0.5 * meta["full_bytes"]
    assert replies == resident
    conv.close()


def test_restore_keeps_the_lossless_parts_exact(llm):
    """A Krul-form state with default retention: unpaired layers come back bit for bit where loaded
    and to rounding where recomputed; paired layers hold direction x magnitude, with the retained
    rows exact. The lean contiguous path and the general path rebuild the same KV."""
    from turnkv.kv.sequence import SequenceKV
    from turnkv.state import split

    conv = llm.conversation(system="A")
    for m in MESSAGES[:2]:
        conv.send(m, max_new_tokens=8)
    seq, n = conv.kv, conv.kv.next_position
    starts = [n - 4, n - 9, 20, 20, 3, 0]
    pairs = [(3, 1), (5, 4)]
    meta, tensors = split.pack_split(seq, starts, pairs)
    layout = split.Layout.from_stored(meta, tensors)
    restored = {}
    for path in ("contiguous", "general"):
        s = SequenceKV(llm.pool)
        if path == "contiguous":
            split.restore_split(llm.state.ctx, s, conv.tokens, meta, tensors)
        else:
            split._restore_general(llm.state.ctx, s, conv.tokens, meta, tensors, layout, True, True)
        restored[path] = [s.gather(layer)[:2] for layer in range(LAYERS)]
        s.free()
    H = llm.config.num_kv_heads
    for layer in range(LAYERS):
        for kind in range(2):
            a, b = restored["contiguous"][layer][kind], restored["general"][layer][kind]
            assert torch.equal(a, b)
            original = seq.gather(layer)[kind]
            s = starts[layer]
            assert torch.allclose(a[:, :s], original[:, :s], atol=1e-5)  # recomputed
            if layer in (0, 2):
                assert torch.equal(a[:, s:], original[:, s:])  # loaded: a copy
    for i, j in pairs:
        for kind, name in ((0, "k"), (1, "v")):
            idx = tensors[f"{i}.{j}.idx_{name}"].long()
            rows = merge.restore_rows(tensors[f"{i}.{j}.dir_{name}"], tensors[f"{i}.{j}.mag_{name}_i"], idx,
                                      tensors[f"{i}.{j}.ret_{name}_i"]).view(H, n - starts[i], -1)
            assert torch.equal(restored["contiguous"][i][kind][:, starts[i]:], rows)
            original = seq.gather(i)[kind][:, starts[i]:].reshape(-1, rows.shape[-1])
            assert torch.equal(rows.reshape(-1, rows.shape[-1])[idx], original[idx])  # outliers kept exactly
    conv.close()


@pytest.mark.parametrize("state", ["krul(ir_threshold=0,fallback=never,recompute_ratio=0.3,{})", "minicache({})",
                                   "krul_fix(recompute_ratio=0.2,{})"])
def test_shared_layers_are_exact_when_every_row_is_retained(llm, resident, state):
    """With retention of every row (threshold below d_min), a merged pair restores both layers' originals: this checks the
    whole merge/pyramid/two-stream path against the resident run, independent of merge quality."""
    conv, replies, locations = run(llm, "state=" + state.format("retain_threshold=-1,max_retained=1"))
    meta = llm.state.tiers.meta(conv.id)["state"]
    assert meta["pairs"] and locations == ["cpu"] * 4
    assert replies == resident
    conv.close()


def test_merge_restores_magnitudes_exactly_and_directions_by_slerp():
    gen = torch.Generator().manual_seed(0)
    xj = torch.randn(200, 16, generator=gen)
    xi = 3 * xj + 0.05 * torch.randn(200, 16, generator=gen)  # nearly the same directions
    xi[7] = -xi[7]  # one outlier row, opposite direction
    m = merge.merge_rows(xi, xj, tau=0.6, retain_threshold=0.05, max_retained=0.05)
    assert m["idx"].tolist() == [7]  # the only row far from its partner
    assert torch.allclose(m["dir"].norm(dim=-1), torch.ones(200), atol=1e-5)
    ri = merge.restore_rows(m["dir"], m["mag_i"], m["idx"], m["ret_i"])
    rj = merge.restore_rows(m["dir"], m["mag_j"], m["idx"], m["ret_j"])
    assert torch.equal(ri[7], xi[7]) and torch.equal(rj[7], xj[7])
    assert torch.allclose(ri.norm(dim=-1), xi.norm(dim=-1), rtol=1e-5)
    assert (ri - xi).norm() / xi.norm() < 0.02 and (rj - xj).norm() / xj.norm() < 0.02
    # tau = 1 keeps layer i's direction, tau = 0 layer j's.
    assert torch.allclose(merge.merge_rows(xi, xj, tau=1.0)["dir"][:7], xi[:7] / xi[:7].norm(dim=-1, keepdim=True), atol=1e-5)
    assert torch.allclose(merge.merge_rows(xi, xj, tau=0.0)["dir"][:7], xj[:7] / xj[:7].norm(dim=-1, keepdim=True), atol=1e-5)
    # Identical rows: the 0/0 SLERP weights take their limit instead of NaN.
    same = merge.merge_rows(xj, xj)
    assert torch.allclose(merge.restore_rows(same["dir"], same["mag_i"], same["idx"], same["ret_i"]), xj, atol=1e-5)


def test_eviction_then_load_restores_uneven_heads_exactly(llm):
    conv = llm.conversation(recipe="evict=snapkv(window=4)+adakv budget=24 state=load")
    conv.send(MESSAGES[0], max_new_tokens=6)
    conv.send(MESSAGES[1], max_new_tokens=6)
    # Bring it back and compare with what a resident twin holds after the same two turns.
    twin = llm.conversation(recipe="evict=snapkv(window=4)+adakv budget=24")
    twin.send(MESSAGES[0], max_new_tokens=6)
    twin.send(MESSAGES[1], max_new_tokens=6)
    assert conv.location == "cpu"
    llm.state.before_turn(conv, 1)  # what the next send does first (on CPU the copies are synchronous)
    assert conv.location == "gpu"
    assert len(set(conv.kv.lengths.flatten().tolist())) > 1  # uneven heads survived
    assert (conv.kv.lengths == twin.kv.lengths).all() and conv.kv.bytes() == twin.kv.bytes()
    for layer in range(LAYERS):
        for a, b in zip(conv.kv.gather(layer), twin.kv.gather(layer)):
            for h, n in enumerate(conv.kv.lengths[layer]):  # entries past a head's length are padding
                assert torch.equal(a[h, :n], b[h, :n])
    a, b = layout_of(conv.kv), layout_of(twin.kv)
    assert all(torch.equal(x, y) for x, y in zip(a.positions, b.positions))
    conv.close()
    twin.close()


def test_pyramid_is_non_increasing_and_within_budget():
    cost = CostModel(1e-6, 1e-10, 1e9)
    for pairs in ([], [(5, 4), (7, 6)], [(3, 0), (6, 2)]):
        starts = schedule.pyramid(4000, 8, pairs, cost, 0.4, 2, 64, 2)
        assert all(a >= b for a, b in zip(starts, starts[1:])) and 0 <= min(starts) and max(starts) <= 4000
        budget = 8 * (4000 - 1600) * schedule.layer_token_bytes(2, 64, 2)
        assert schedule.stored_bytes(starts, 4000, pairs, 2, 64, 2) <= budget
    # Sharing frees budget and load time: the pyramid recomputes less than the uniform split.
    assert sum(schedule.pyramid(4000, 8, [(5, 4), (7, 6)], cost, 0.4, 2, 64, 2)) < 8 * 1600


def test_calibrated_ratio_balances_the_two_streams():
    cost = CostModel(1e-6, 0.0, 1e9)
    n, N, H, D, es = 10000, 8, 2, 64, 2
    r = schedule.best_ratio(n, N, cost, H, D, es)
    t_c = cost.compute_s([[r * n] * N])[0]
    t_l = cost.load_s((1 - r) * n * N * schedule.layer_token_bytes(H, D, es))
    assert abs(t_c - t_l) <= 0.05 * max(t_c, t_l)


def test_host_pool_gives_back_empty_tensors():
    """A deep pyramid stores empty tensors (layers recomputed whole); releasing them must free the
    right extents (an empty tensor's data_ptr() is 0)."""
    from turnkv.kv.host_pool import HostPool

    pool = HostPool(1 << 16, pin=False)
    stored = pool.store({"k.0": torch.zeros(0, 8), "k.1": torch.ones(10, 8), "idx": torch.zeros(0, dtype=torch.int32)})
    pool.release(stored)
    assert pool.used == 0 and pool._free == [(0, pool.capacity)]
