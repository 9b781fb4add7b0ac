"""Engines whose page pool stores int8 / fp8 KV, on a tiny random llama: conversations against the
full-precision engine turn by turn, eviction's exact budgets, the state tiers' round trip, the
CUDA-graph decode step's host side and the graphed decode selections (run without a graph on CPU)."""

from __future__ import annotations

import pytest
import torch

import turnkv

MESSAGES = ["The quick brown fox jumps over the lazy dog. " * 6 + "Tell me a story about a cat.",
            "And then what happened?", "Thanks! One more?"]
# Teacher-forced along the full engine's greedy reply, per turn: top-1 agreement at least, and the
# largest log-probability difference and mean KL(full || quantized) at most. Measured on this model
# (worst turn of three, 16 tokens each): int8 agreement 1.0, logprob 0.0017, KL 1.9e-7; fp8 agreement
# 0.9375, logprob 0.0092, KL 1.6e-6. Margins: one token of agreement, 2x the logprob, 3x the KL.
TOLERANCE = {"int8": {"agreement": 0.9375, "logprob": 0.004, "kl": 6e-7},
             "fp8": {"agreement": 0.875, "logprob": 0.02, "kl": 5e-6}}


def run(llm, recipe=None, force=None, max_new_tokens=16):
    conv = llm.conversation(system="You are helpful.", recipe=recipe)
    try:
        out = []
        for i, message in enumerate(MESSAGES):
            r = conv.send(message, max_new_tokens=max_new_tokens, logprobs=True, ignore_eos=True,
                          force=force[i] if force else None)
            out.append((r.token_ids, r.logprobs, conv.kv.lengths.copy(), conv.kv_bytes))
        return out
    finally:
        conv.close()


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    def make(kv):
        return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", kv_dtype=kv)

    return {kv: make(kv) for kv in (None, "int8", "fp8")}


@pytest.fixture(scope="module")
def reference(engines):
    return run(engines[None])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_conversation_stays_close_to_full_precision_turn_by_turn(engines, reference, kv):
    tol = TOLERANCE[kv]
    forced = run(engines[kv], force=[tokens for tokens, *_ in reference])
    for turn, ((tokens, ref_lp, _, ref_bytes), (_, lp, _, kv_bytes)) in enumerate(zip(reference, forced)):
        agreement = (lp.argmax(-1) == torch.tensor(tokens)).float().mean().item()
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        assert agreement >= tol["agreement"], f"turn {turn + 1}"
        assert (lp - ref_lp).abs().max().item() <= tol["logprob"], f"turn {turn + 1}"
        assert 0 <= kl <= tol["kl"], f"turn {turn + 1}"
        # fp32 rows of 16 (64 bytes) against one-byte codes and a 4-byte scale: 20 / 64 of the bytes
        assert kv_bytes * 64 == ref_bytes * 20
    # Free-running, the int8 engine's greedy replies are the full engine's.
    if kv == "int8":
        assert [t for t, *_ in run(engines[kv])] == [t for t, *_ in reference]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_eviction_keeps_exact_budgets(engines, kv):
    from turnkv.kv.sequence import SequenceKV
    from turnkv.methods.recipe import Recipe

    llm, budget, n = engines[kv], 24, 150
    for spec, uniform in ((f"snapkv budget={budget} kv_dtype={kv}", True), (f"ada-snapkv budget={budget}", False)):
        recipe = llm.resolve_recipe(Recipe.parse(spec))
        seq, st = SequenceKV(llm.pool), recipe.new_state(llm.config.num_layers)
        try:
            free = llm.pool.free_pages(0)
            llm.runner.prefill(seq, list(range(5, 5 + n)), context=st.context)
            recipe.after_prompt(seq, st, n, llm.model.inv_freq, turn=1)
            lengths = seq.lengths
            assert (lengths.mean(axis=1) == budget).all()  # the layer budget, exactly
            if uniform:
                assert (lengths == budget).all()
            # the pages (and their scales) of evicted tokens went back to the pool
            assert llm.pool.free_pages(0) == free - int(seq.num_pages[0].sum())
            assert seq.bytes() == int(seq.num_pages.sum()) * llm.pool.page_size * llm.pool.token_bytes
        finally:
            seq.free()
    # Through a conversation: every turn compresses the finished turns to the budget and runs.
    out = run(llm, recipe=f"snapkv budget={budget} kv_dtype={kv}")
    assert all(len(tokens) == 16 and torch.isfinite(lp).all() for tokens, lp, *_ in out)
    assert out[-1][3] < run(llm)[-1][3]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_state_offload_and_restore_is_bit_identical(engines, kv):
    """The load strategy stores the codes and scales and puts them back: the next turns' tokens and
    log-probabilities are those of the conversation that stayed resident."""
    llm = engines[kv]
    resident = run(llm, "state=gpu")
    for state in ("load", "load(layerwise=false)"):
        loaded = run(llm, f"state={state}")
        for (a, lpa, *_), (b, lpb, *_) in zip(resident, loaded):  # (between turns the KV is off the pool)
            assert a == b and torch.equal(lpa, lpb)
    # With eviction (uneven heads: the general restore path).
    evicting = [run(llm, f"ada-snapkv budget=24 state={s}") for s in ("gpu", "load")]
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(*evicting))


def test_stored_state_is_the_narrow_codes(engines):
    llm = engines["int8"]
    conv = llm.conversation(recipe="state=load")
    try:
        conv.send(MESSAGES[0], max_new_tokens=4)
        meta = llm.state.tiers.meta(conv.id)["state"]
        _, _, tensors = llm.state.tiers.get(conv.id)
        n = meta["next_position"]
        assert tensors["k.0"].dtype == torch.int8 and tensors["k_scale.0"].dtype == torch.float32
        assert llm.state.stored_bytes(conv) == n * llm.kv_bytes_per_token()  # codes + scales of every token
        conv.send(MESSAGES[1], max_new_tokens=4)
    finally:
        conv.close()


@pytest.mark.parametrize("state", ["partial(recompute_ratio=0.5)", "minicache(layer_ratio=1)", "recompute"])
def test_lossy_and_recomputing_restores_run_on_quantized_pools(engines, state):
    """Restores that recompute a prefix (round-tripped K/V, as the prefill read them) or merge layer
    pairs (in the compute dtype, requantized on the way back) stay close to the resident state."""
    llm = engines["int8"]
    resident = run(llm, "state=gpu")
    restored = run(llm, f"state={state}", force=[t for t, *_ in resident])
    for (_, lpa, *_), (_, lpb, *_) in zip(resident, restored):
        assert (lpa - lpb).abs().max() < (0.5 if "minicache" in state else 1e-4)


def test_graph_step_host_side_equals_eager_on_int8(chat_model_dir):
    from turnkv.engine.cuda_graphs import GraphedDecode

    eager = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4, kv_dtype="int8")
    static = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4, kv_dtype="int8")
    static.runner.graphs = GraphedDecode(static.model, static.pool, static.max_model_len, max_batch=4)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    for recipe in (None, "snapkv budget=12 schedule=decode every=5"):
        a, b = (llm.generate(prompts, recipe=recipe, max_new_tokens=20, ignore_eos=True) for llm in (eager, static))
        assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("recipe", [
    "decode=quest(budget=64,dense_layers=1)",
    "lserve decode=lserve(budget=64,physical_page=32,reuse=3) prefill=streaming_heads(pattern=random,ratio=0.5,sink=16,local=32)",
    "loopserve-d decode=loopserve(budget=40,warmup=3,interval=4)",
])
def test_graphed_decode_selection_equals_eager_on_int8(chat_model_dir, monkeypatch, recipe):
    """Quest / LServe page statistics from the compute-dtype keys in both paths (the graph's per-layer
    update, the eager step's `written`), LoopServe's re-scoring over the codes and scales."""
    from tests.engine.test_graph_selection import assert_same, drive
    from turnkv.engine.cuda_graphs import GraphedDecode

    eager = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", kv_dtype="int8")
    graphed = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", kv_dtype="int8")
    graphed.runner.graphs = GraphedDecode(graphed.model, graphed.pool, graphed.max_model_len, max_batch=4)
    lengths = [300, 89, 190]
    a = drive(eager, recipe, lengths, 12, monkeypatch)
    b = drive(graphed, recipe, lengths, 12, monkeypatch)
    assert_same(a, b)
    assert b[2] == []


def test_disk_tier_keeps_the_codes(chat_model_dir, tmp_path):
    """fp8 codes and their scales through the disk tier (safetensors) and back: the same next turn."""
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", kv_dtype="fp8", state_disk_dir=str(tmp_path))
    replies = []
    for offload in (False, True):
        conv = llm.conversation(recipe="state=load")
        try:
            conv.send(MESSAGES[0], max_new_tokens=6, ignore_eos=True)
            if offload:
                assert conv.offload("disk") == "disk" and conv.location == "disk"
                _, tensors = llm.state.tiers.disk.read(conv.id)
                assert tensors["k.1"].dtype == torch.float8_e4m3fn and tensors["v_scale.1"].dtype == torch.float32
            r = conv.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True, logprobs=True)
            replies.append((r.token_ids, r.logprobs))
        finally:
            conv.close()
    assert replies[0][0] == replies[1][0] and torch.equal(replies[0][1], replies[1][1])
