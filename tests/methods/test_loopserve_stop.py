"""LoopServe's early stop in prefill: a unit whose taken lines already cover dense_above of its
causal cells stops its greedy and attends densely. Against the same prefill without the stop: the
same dense decisions and the same output to the bit, far fewer greedy steps on near-uniform
attention, and the same lines where attention is peaked (nothing stops). And the `recovered` mask
attend builds once per sequence for keys at their entries, against the per-head mask."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import lines  # noqa: E402
from turnkv.methods.loopserve import greedy as greedy_module  # noqa: E402
from turnkv.methods.loopserve import prefill as prefill_module  # noqa: E402
from turnkv.methods.loopserve.prefill import LoopServePrefill  # noqa: E402
from turnkv.methods.recipe import Recipe  # noqa: E402

from .test_loopserve import PROMPTS, prefill_logits  # noqa: E402


def chunk_keys(heads, B=1, H=2, T=96, hist=24, seed=0):
    """Keys at their entries (no eviction) for a chunk of T rows after hist keys. heads: one kind per
    query head, "uniform" (tiny scores: near-uniform attention), "sink" (every row on key 0) or
    "slash" (row p on key p - 3, one-hot directions: D > S)."""
    g = torch.Generator().manual_seed(seed)
    S, Hq = hist + T, len(heads)
    D = S + 1
    q = torch.randn(B, Hq, T, D, generator=g) * 0.02
    k = torch.randn(B, H, S, D, generator=g) * 0.02
    k[:, :, 0, -1] = 1.0  # the sink's direction
    k[:, :, torch.arange(S), torch.arange(S)] += 1.0  # key c: direction c
    rows = torch.arange(hist, S)
    for h, kind in enumerate(heads):
        if kind == "sink":
            q[:, h, :, -1] = 400.0
        elif kind == "slash":
            q[:, h, torch.arange(T), (rows - 3).clamp_min(0)] = 400.0
    v = torch.randn(B, H, S, D, generator=g)
    q_pos = rows.expand(B, T)
    return lines.Keys(q, k, v, q_pos, torch.arange(S).expand(B, H, S).clone(), None, hist, S)


def attend(method, keys, stop=True, monkeypatch=None, backend=None):
    """method.attend(0, keys) with the early stop on or off (and the greedy's backend forced)."""
    with monkeypatch.context() as m:
        if not stop:
            m.setattr(LoopServePrefill, "_stop_cells", lambda self, *args: None)
        if backend is not None:
            real = greedy_module.greedy
            m.setattr(prefill_module, "greedy", lambda *a, **kw: real(*a, **kw, backend=backend))
        return method.attend(0, keys)


def steps(stats):
    return (stats["vertical"] + stats["slash"]).reshape(-1)


@pytest.mark.parametrize("granularity", ["query", "kv"])
def test_near_uniform_attention_stops_early_with_the_same_output(monkeypatch, granularity):
    keys = chunk_keys(["uniform"] * 4, B=2)
    method = LoopServePrefill(granularity=granularity)
    out, st = attend(method, keys, monkeypatch=monkeypatch)
    ref, st_ref = attend(method, keys, stop=False, monkeypatch=monkeypatch)
    assert torch.equal(out, ref)
    assert torch.equal(st["computed"], st_ref["computed"]) and torch.equal(st["causal"], st_ref["causal"])
    assert torch.equal(st["computed"], st["causal"])  # every unit dense, either way
    assert (steps(st) * 3 <= steps(st_ref)).all()
    # The stop bound holds at the stop: the truncated lines alone already reach dense_above.
    layout = lines.kernel_layout(keys)
    stop_cells = method._stop_cells(keys, granularity == "query", layout)
    vertical, slash, *_ = method.select(keys, 0, stop_cells=stop_cells)
    computed, causal = lines.contiguous_counts(keys, vertical, slash, granularity == "query", *layout)
    assert (computed >= method.dense_above * causal).all()
    assert torch.equal(stop_cells.view_as(causal), method.dense_above * causal)


@pytest.mark.parametrize("granularity", ["query", "kv"])
def test_peaked_and_mixed_heads(monkeypatch, granularity):
    """Peaked heads (a sink, a slash) select a few lines and never stop: identical lines and stats.
    Mixed with near-uniform heads, those stop and go dense, and the output is still the same."""
    heads = ["sink", "slash", "sink", "slash"] if granularity == "query" else ["sink", "sink", "slash", "slash"]
    keys = chunk_keys(heads, seed=1)
    method = LoopServePrefill(granularity=granularity)
    out, st = attend(method, keys, monkeypatch=monkeypatch)
    ref, st_ref = attend(method, keys, stop=False, monkeypatch=monkeypatch)
    assert torch.equal(out, ref)
    for name in ("computed", "vertical", "slash", "estimated", "recovered"):
        assert torch.equal(st[name], st_ref[name])
    assert (st["computed"] < method.dense_above * st["causal"]).all()  # sparse: no unit went dense
    assert (steps(st) <= 8).all()

    mixed = ["uniform", "sink", "uniform", "slash"] if granularity == "query" else ["uniform", "uniform", "slash", "sink"]
    keys = chunk_keys(mixed, seed=2)
    out, st = attend(method, keys, monkeypatch=monkeypatch)
    ref, st_ref = attend(method, keys, stop=False, monkeypatch=monkeypatch)
    assert torch.equal(out, ref) and torch.equal(st["computed"], st_ref["computed"])
    dense = (st["computed"] == st["causal"]).reshape(-1)
    stopped = steps(st) < steps(st_ref)
    assert torch.equal(stopped, dense) and stopped.any() and not stopped.all()
    assert torch.equal(steps(st)[~stopped], steps(st_ref)[~stopped])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_backends_stop_alike(monkeypatch):
    keys = chunk_keys(["uniform", "sink", "uniform", "slash"], seed=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = dataclasses.replace(keys, **{f.name: getattr(keys, f.name).to(device) for f in dataclasses.fields(keys)
                                        if isinstance(getattr(keys, f.name), torch.Tensor)})
    method = LoopServePrefill()
    results = [attend(method, keys, monkeypatch=monkeypatch, backend=b) for b in ("torch", "triton", "python")]
    for out, st in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(st["vertical"], results[0][1]["vertical"]) and torch.equal(st["slash"], results[0][1]["slash"])


def test_no_stop_where_it_could_change_the_decision():
    keys = chunk_keys(["uniform"] * 2)
    layout = lines.kernel_layout(keys)
    assert LoopServePrefill()._stop_cells(keys, True, layout) is not None
    assert LoopServePrefill(lengths="sampled")._stop_cells(keys, True, layout) is None
    assert not LoopServePrefill(dense_above=None)._may_go_dense(keys)
    assert not LoopServePrefill()._may_go_dense(dataclasses.replace(keys, window=16))
    # Sequences whose rows do not span [first_position, end_position): no stop.
    shifted = dataclasses.replace(keys, first_position=keys.first_position - 1)
    assert LoopServePrefill()._stop_cells(shifted, True, layout) is None


def test_engine_prefill_equals_the_walk_without_the_stop(chat_llm, monkeypatch):
    """A tiny random model (near-uniform attention), prefilled in chunks: the logits equal those
    without the early stop to the bit, and units did stop."""
    ids = chat_llm.encode(PROMPTS[0] + " " + PROMPTS[1])
    chunks = lambda x: [x[:30], x[30:]]  # noqa: E731
    recipe = Recipe.parse("loopserve-p")
    got, st = prefill_logits(chat_llm, ids, recipe, chunks)
    with monkeypatch.context() as m:
        m.setattr(LoopServePrefill, "_stop_cells", lambda self, *args: None)
        ref, st_ref = prefill_logits(chat_llm, ids, recipe, chunks)
    assert torch.equal(got, ref)
    taken = [steps(e) for e in st.pattern_stats]
    taken_ref = [steps(e) for e in st_ref.pattern_stats]
    assert sum(int(t.sum()) for t in taken) < sum(int(t.sum()) for t in taken_ref)
    for e, e_ref in zip(st.pattern_stats, st_ref.pattern_stats):
        assert torch.equal(e["computed"], e_ref["computed"])


@pytest.mark.parametrize("per_q", [True, False])
def test_line_mask_at_entries_equals_the_per_head_mask(per_q):
    """attend's `recovered` mask with keys at their entries (offsets built once per sequence) is the
    per-head mask, with padding, a window, batches and query groups."""
    g = torch.Generator().manual_seed(7)
    for B, ragged, window in ((1, False, None), (2, True, None), (3, False, 17)):
        keys = chunk_keys(["uniform"] * 4, B=B, seed=B)
        if ragged:
            valid = torch.ones_like(keys.k_pos, dtype=torch.bool)
            valid[:, -1, -5:] = False
            keys = dataclasses.replace(keys, valid=valid)
        keys = dataclasses.replace(keys, window=window)
        U = 4 if per_q else 2
        vertical = torch.rand(B * U, keys.k.shape[2], generator=g) < 0.3
        slash = torch.rand(B * U, keys.end_position, generator=g) < 0.3
        rows = torch.tensor([0, 5, 50, 95])
        for r in (rows, None):
            expected = lines.line_mask(keys, vertical, slash, per_q, r)
            assert torch.equal(lines.line_mask(keys, vertical, slash, per_q, r, at_entries=True), expected)
