"""Conversations across the tiers: LRU demotion when the GPU tier is full, restart durability of the
disk tier, recompute when a stored file is corrupt, clear errors that lose nothing when every tier is
full; and the pieces under Krul checked against brute force (estimator, pyramid recompute)."""

from __future__ import annotations

import shutil

import pytest
import torch

import turnkv
from tests.state.conftest import LAYERS
from turnkv.attention.reference import attention_weights
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.tiers import StateTiersFullError
from turnkv.state.estimator import TurnQueries, attention_statistics, ir_regions
from turnkv.state.split import pack_split, restore_split

MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB")


@pytest.fixture(scope="module")
def reference(llm):
    """Replies of resident conversations: for system prompts "A" and "B"."""
    out = {}
    for system in ("A", "B"):
        conv = llm.conversation(system=system)
        out[system] = [conv.send(m, max_new_tokens=10).token_ids for m in MESSAGES]
        conv.close()
    return out


def test_lru_demotion_moves_the_idle_conversation_down_and_back(model_dir, reference):
    # 13 pages per layer: both fit after turn 1; from turn 2 on, each turn demotes the other one.
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory=13 * 2048 * LAYERS, page_size=16)
    a, b = llm.conversation(system="A"), llm.conversation(system="B")
    got = {"A": [], "B": []}
    for m in MESSAGES:
        got["A"].append(a.send(m, max_new_tokens=10).token_ids)
        got["B"].append(b.send(m, max_new_tokens=10).token_ids)
    assert b.location == "gpu" and a.location == "cpu"
    assert got == reference  # demoted (full KV, like load) and restored without a change
    demoted = [e["conversation"] for e in llm.state.events if e["event"] == "demoted"]
    # Each demotion took the idle one, so they alternate, and the last one was a (b's last turn).
    assert len(demoted) >= 3 and demoted[-1] == a.id
    assert all(x != y for x, y in zip(demoted, demoted[1:]))
    assert all(e["tier"] == "cpu" for e in llm.state.events if e["event"] == "demoted")


def test_compressed_conversations_need_room_for_what_they_keep_not_for_their_positions(model_dir):
    """Room for a turn is counted from the tokens each head keeps: two conversations compressed to a
    few pages each stay resident in a pool that could not hold either one's positions again."""
    doc = " ".join(["the river runs past the old mill and the bakery"] * 30)
    messages = [doc, "and then what?", "why so?", "tell me more"]

    def play(llm):
        convs = [llm.conversation(recipe="snapkv budget=16") for _ in range(2)]
        replies = [[c.send(m, max_new_tokens=4).token_ids for m in messages[:2]] for c in convs]
        for m in messages[2:]:
            for c, r in zip(convs, replies):
                r.append(c.send(m, max_new_tokens=4).token_ids)
        return convs, replies

    big = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", page_size=16)
    probe = big.conversation(recipe="snapkv budget=16")
    probe.send(messages[0], max_new_tokens=4)
    peak = int(probe.kv.num_pages.sum(axis=1).max())  # the uncompressed first turn
    probe.send(messages[1], max_new_tokens=4)
    kept = int(probe.kv.num_pages.sum(axis=1).max())  # compressed at the second turn's prefill
    positions = probe.kv.next_position
    probe.close()
    _, reference = play(big)

    pages = peak + kept + 4  # a first turn beside one compressed conversation, and little more
    heads = big.pool.num_kv_heads
    assert 2 * kept + heads * (-(-positions // 16) + 1) > pages  # room for the positions would demote
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory=pages * 2048 * LAYERS, page_size=16)
    convs, replies = play(llm)
    assert replies == reference
    assert [e for e in llm.state.events if e["event"] == "demoted"] == []
    assert all(c.location == "gpu" for c in convs)


def test_a_conversation_mid_turn_is_never_demoted(model_dir, reference):
    """a's stream is paused mid-reply while b needs room: b must not take a's pages (a's next decode
    step reads them), so b's turn fails cleanly instead, and a finishes its reply unchanged."""
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory=13 * 2048 * LAYERS, page_size=16)
    a, b = llm.conversation(system="A"), llm.conversation(system="B")
    assert a.send(MESSAGES[0], max_new_tokens=10).token_ids == reference["A"][0]
    assert b.send(MESSAGES[0], max_new_tokens=10).token_ids == reference["B"][0]
    stream = a.stream(MESSAGES[1], max_new_tokens=10)
    next(stream)  # a's turn is under way: its KV is in use
    with pytest.raises(turnkv.KVCacheFullError):
        b.send(MESSAGES[1] + " " + "and more " * 40, max_new_tokens=10)
    assert a.location == "gpu"
    for _ in stream:
        pass
    assert a.last_reply.token_ids == reference["A"][1]
    # Once a's turn is over it is idle again and may move down for b.
    assert b.send(MESSAGES[1], max_new_tokens=10).token_ids == reference["B"][1]
    assert a.location == "cpu"


def test_full_tiers_give_a_clear_error_and_lose_nothing(model_dir, reference):
    # 9 pages per layer hold one conversation; the CPU tier holds 4 KiB and there is no disk tier.
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory=9 * 2048 * LAYERS, state_cpu_memory=4096)
    a, b = llm.conversation(system="A"), llm.conversation(system="B")
    first = a.send(MESSAGES[0], max_new_tokens=10).token_ids
    with pytest.raises(StateTiersFullError, match="no room"):
        b.send(MESSAGES[0], max_new_tokens=10)  # b needs a's pages, and a has nowhere to go
    assert a.location == "gpu" and b.location is None and b.turns == []
    with pytest.raises(StateTiersFullError):
        a.offload("cpu")
    assert a.location == "gpu"
    second = a.send(MESSAGES[1], max_new_tokens=10).token_ids
    assert [first, second] == reference["A"][:2]  # a continues as if nothing happened
    # A strategy that offloads after each turn keeps the state on the GPU when it cannot store it.
    a.close()
    c = llm.conversation(system="A", recipe="state=load")
    replies = [c.send(m, max_new_tokens=10).token_ids for m in MESSAGES[:2]]
    assert replies == reference["A"][:2] and c.location == "gpu"
    assert any(e["event"] == "kept_on_gpu" and e["conversation"] == c.id for e in llm.state.events)


@pytest.mark.parametrize("state", ["load", "partial(recompute_ratio=0.5)", "gpu"])
def test_disk_state_survives_a_restart(model_dir, reference, tmp_path, state):
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=tmp_path)
    conv = llm.conversation(system="A", recipe=f"state={state}")
    first = [conv.send(m, max_new_tokens=10).token_ids for m in MESSAGES[:2]]
    assert conv.offload("disk") == "disk"
    conversation_id = conv.id
    del llm, conv
    restarted = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=tmp_path)
    conv = restarted.resume(conversation_id)
    assert conv.location == "disk" and conv.turns[-1].reply.token_ids == first[-1]
    third = conv.send(MESSAGES[2], max_new_tokens=10)
    assert [*first, third.token_ids] == reference["A"]
    assert third.cached_tokens == conv.turns[-1].start  # the history came from the disk, not a re-prefill
    assert not [e for e in restarted.state.events if e["event"] == "corrupt_state_recomputed"]


@pytest.mark.parametrize("recipe,rate,recomputed", [
    ("state=load", 1.0, True),  # a disk of 1 byte/s: the read would take longer than the recompute
    ("state=load", 1e18, False),  # a fast disk: read what was stored
    ("state=krul(ir_threshold=0,fallback=never)", 1.0, True),
    ("snapkv keep_ratio=0.5,state=load", 1.0, False),  # evicted: a prefill would not rebuild it
])
def test_a_slow_disk_is_recomputed_instead_of_read(model_dir, reference, tmp_path, recipe, rate, recomputed):
    store, lost_store = tmp_path / "store", tmp_path / "lost"
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=store)
    conv = llm.conversation(system="A", recipe=recipe)
    first = [conv.send(m, max_new_tokens=10).token_ids for m in MESSAGES[:2]]
    assert conv.offload("disk") == "disk"
    # A copy of the store whose tensors file is gone: restored by the recompute of the history.
    shutil.copytree(store, lost_store)
    for f in lost_store.glob("*.safetensors"):
        f.unlink()
    lost = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=lost_store)
    recomputed_reply = lost.resume(conv.id).send(MESSAGES[2], max_new_tokens=10).token_ids
    restarted = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=store)
    restarted.state.tiers.disk.read_rate = rate
    conv = restarted.resume(conv.id)
    third = conv.send(MESSAGES[2], max_new_tokens=10)
    events = [e for e in restarted.state.events if e["event"] == "disk_state_recomputed"]
    assert len(events) == int(recomputed)
    if recomputed:
        assert events[0]["read_s"] > events[0]["recompute_s"] > 0
        assert third.token_ids == recomputed_reply
        if recipe == "state=load":  # exact all along: the resident run's tokens
            assert [*first, third.token_ids] == reference["A"]
    # The disk copy is gone once the turn is done (these strategies store the new state on the CPU).
    assert conv.location == "cpu" and not restarted.state.tiers.keys("disk")


def test_a_corrupt_file_falls_back_to_recompute(model_dir, reference, tmp_path):
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=tmp_path)
    conv = llm.conversation(system="A", recipe="state=load")
    first = [conv.send(m, max_new_tokens=10).token_ids for m in MESSAGES[:2]]
    conv.offload("disk")
    [tensors_file] = list(tmp_path.glob("*.safetensors"))
    data = bytearray(tensors_file.read_bytes())
    tensors_file.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    restarted = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=tmp_path)
    conv = restarted.resume(conv.id)
    third = conv.send(MESSAGES[2], max_new_tokens=10)
    assert [*first, third.token_ids] == reference["A"]
    [event] = [e for e in restarted.state.events if e["conversation"] == conv.id]
    assert event["event"] == "corrupt_state_recomputed" and "truncated or corrupt" in event["error"]


def test_an_offload_without_gpu_memory_to_stage_the_state_goes_through_host_memory(model_dir, reference, monkeypatch):
    """Packing a state stages its rows on the GPU. When that finds no memory (an offload that must make
    room), the pack runs again one layer at a time through host memory; when even that fails, the
    conversation stays where it was (a StateTiersFullError: the server drops another one instead)."""
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", state_cpu_memory="64MiB")
    a = llm.conversation(system="A")
    first = a.send(MESSAGES[0], max_new_tokens=10).token_ids
    strategy = type(a.recipe.state)
    real_pack, calls = strategy.pack, []

    def staged_on_host_only(self, ctx, *args, **kwargs):
        calls.append(ctx.stage_on_host)
        if not ctx.stage_on_host:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 66.00 MiB.")
        return real_pack(self, ctx, *args, **kwargs)

    monkeypatch.setattr(strategy, "pack", staged_on_host_only)
    assert a.offload("cpu") == "cpu" and calls == [False, True]
    assert llm.state.ctx.stage_on_host is False
    assert [first, a.send(MESSAGES[1], max_new_tokens=10).token_ids] == reference["A"][:2]

    def no_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 66.00 MiB.")

    monkeypatch.setattr(strategy, "pack", no_memory)
    with pytest.raises(StateTiersFullError, match="no GPU memory to stage"):
        a.offload("cpu")
    assert a.location == "gpu"
    monkeypatch.undo()
    assert a.send(MESSAGES[2], max_new_tokens=10).token_ids == reference["A"][2]


def test_a_state_packed_through_host_memory_equals_the_one_staged_on_the_gpu(llm):
    conv = llm.conversation(system="A")
    conv.send(MESSAGES[0], max_new_tokens=10)
    meta, on_gpu = pack_split(conv.kv, [3] * LAYERS)
    meta_host, on_host = pack_split(conv.kv, [3] * LAYERS, on_host=True)
    assert meta_host == meta and on_host.keys() == on_gpu.keys()
    assert all(on_host[k].device.type == "cpu" and torch.equal(on_host[k], on_gpu[k].cpu()) for k in on_gpu)
    conv.close()


def test_estimator_matches_the_full_attention_maps(llm):
    conv = llm.conversation(system="A")
    conv.send(MESSAGES[0], max_new_tokens=4)
    window = TurnQueries(LAYERS, 0)
    conv.method_state.window = window
    conv.send(MESSAGES[1], max_new_tokens=6)  # a prefill block and decode rows
    queries, positions, is_decode = window.take()
    assert is_decode.sum() == 5 and (~is_decode).sum() == len(positions) - 5
    ir, distance = attention_statistics(conv.kv, queries, positions, is_decode)
    P = conv.kv.next_position
    (i0, i1), (r0, r1) = ir_regions(P)
    maps = []
    for layer in range(LAYERS):
        k, _, pos = conv.kv.gather(layer)
        mask = (pos[:, None, :] <= positions[None, :, None])[None]  # [1, H, T, S]
        w = attention_weights(queries[layer].transpose(0, 1)[None], k[None], mask)[0]  # [Hq, T, S]
        maps.append(w)
    H = maps[0].shape[0]
    for i in range(LAYERS):
        score = (maps[i][..., i0:i1].sum(-1) + maps[i][..., r0:r1].sum(-1)).mean()
        assert torch.allclose(ir[i], score, atol=1e-5)
        for j in range(LAYERS):
            expected = torch.stack([(maps[i][h] - maps[j][h]).norm() for h in range(H)]).mean()
            assert torch.allclose(distance[i, j], expected, atol=1e-4, rtol=1e-4)
    conv.close()


def test_pyramid_recompute_rebuilds_the_kv(llm):
    conv = llm.conversation(system="A")
    for m in MESSAGES:
        conv.send(m, max_new_tokens=8)
    n = conv.kv.next_position
    starts = [n, n - 5, 20, 20, 3, 0]  # recompute all of layer 0, nothing of layer 5
    meta, tensors = pack_split(conv.kv, starts)
    assert tensors["k.0"].shape[0] == 0 and tensors["k.5"].shape[0] == 2 * n
    seq = SequenceKV(llm.pool)
    restore_split(llm.state.ctx, seq, conv.tokens, meta, tensors)
    for layer in range(LAYERS):
        for a, b in zip(seq.gather(layer)[:2], conv.kv.gather(layer)[:2]):
            assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="must not increase"):
        restore_split(llm.state.ctx, SequenceKV(llm.pool), conv.tokens, {**meta, "starts": [0, 5, 0, 0, 0, 0]}, tensors)
    seq.free()
    conv.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the two restore streams need CUDA")
def test_recompute_and_load_streams_restore_the_kv_on_gpu():
    """The split restore's recompute and load streams run concurrently on CUDA and must not race: the
    restored KV is the prefilled one (the loaded part bit for bit, the recomputed part within bf16
    rounding). How well the streams overlap is a benchmark figure (benchmarks/state/gpu_state_restore.py,
    column overlap), not a test."""
    llm = turnkv.LLM("llama-3.2-1b", dtype="bfloat16", device="cuda", kv_memory="8GiB", state_cpu_memory="2GiB")
    ids = torch.randint(0, 32000, (8192,)).tolist()
    ref = SequenceKV(llm.pool)
    llm.runner.prefill(ref, ids)
    n = ref.next_position
    ctx = llm.state.ctx
    starts = [int(round(ctx.recompute_ratio(n, "cpu") * n)) or 512] * llm.config.num_layers
    meta, tensors = pack_split(ref, starts)
    host = llm.state.tiers.host.store(tensors)
    for _ in range(3):
        s = SequenceKV(llm.pool)
        restore_split(ctx, s, ids, meta, host, gate=False).wait_all()
        torch.cuda.synchronize()
        assert s.next_position == n
        for layer in range(llm.config.num_layers):
            for a, b in zip(s.gather(layer)[:2], ref.gather(layer)[:2]):
                assert torch.equal(a[:, starts[layer]:], b[:, starts[layer]:]), layer
                # A race leaves zeros or another token's rows (relative error near 1), not bf16 rounding.
                error = (a - b).float().norm() / b.float().norm()
                assert error < 0.05, (layer, float(error))
        s.free()
    ref.free()
