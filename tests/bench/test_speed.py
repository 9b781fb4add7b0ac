"""`turnkv bench speed` on a tiny model: every planned figure is measured and set against its floor,
the transformers peer runs on turnkv's own weights, and the report is written."""

from __future__ import annotations

import json
import time

import pytest
import torch

import turnkv
from turnkv.bench import hardware, peers, speed_report
from turnkv.bench.speed import SpeedConfig, run_speed
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe


@pytest.fixture(scope="module")
def tiny(chat_model_dir):
    return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB")


def test_transformers_peer_shares_turnkv_weights_and_agrees(tiny):
    hf = peers.transformers_model(tiny)
    ours = {p.data_ptr() for p in tiny.model.parameters()}
    assert hf.model.layers[0].self_attn.q_proj.weight.data_ptr() in ours  # a view, not a copy
    ids = list(range(3, 40))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0, -1].float()
    seq = SequenceKV(tiny.pool)
    mine = tiny.runner.prefill(seq, ids)
    seq.free()
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_transformers_peer_prefills_long_batches_in_chunks(tiny, monkeypatch):
    hf = peers.transformers_model(tiny)
    seen = []
    generate = hf.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prefill_chunk_size"))
        return generate(*args, **kwargs)

    monkeypatch.setattr(hf, "generate", spy)
    prompts = torch.randint(3, 100, (2, 40))
    row = peers.transformers_generate(hf, prompts, 4, tiny.device, repeat=1, prefill_chunk=16)
    assert seen == [16, 16, 16]  # warm-up, TTFT, then the timed n-token run; all chunked
    assert row["note"] == "transformers chunked prefill, 16 tokens per chunk" and row["tokens_per_s"] > 0
    seen.clear()
    row = peers.transformers_generate(hf, prompts, 4, tiny.device, repeat=1, prefill_chunk=64)
    assert seen == [None, None, None] and "note" not in row  # a chunk longer than the prompt is no chunk


def test_batched_rows_drive_the_recipe_as_the_engine_does(tiny, monkeypatch):
    # A selecting recipe's batched row must time its selection, not dense decode: every step hands
    # the runner the conversations' step contexts with their selectors, and the recipe's per-step
    # hook runs for each conversation.
    from turnkv.bench.speed import measure

    decode, hook = tiny.runner.decode, Recipe.after_decode_step
    seen, hooked = [], []

    def spy(seqs, tokens, contexts=None):
        seen.append([c.selector for c in contexts])
        return decode(seqs, tokens, contexts)

    monkeypatch.setattr(tiny.runner, "decode", spy)
    monkeypatch.setattr(Recipe, "after_decode_step", lambda self, *a, **k: hooked.append(1) or hook(self, *a, **k))
    cfg = SpeedConfig(contexts=[64], new_tokens=4, repeat=1)
    hw = {"weight_bytes": 1, "copy_bandwidth": 1e9, "matmul_rate": 1e12}
    row = measure(tiny, Recipe.parse("decode=quest(budget=16,dense_layers=0)"), 64, 2, cfg, hw)
    # The warm-up generation (one prompt, skip_tokens + 8 tokens: 23 steps), then the batch of two (3 steps).
    assert [len(sel) for sel in seen] == [1] * (cfg.skip_tokens + 7) + [2] * 3
    assert all(s is not None for sel in seen for s in sel)
    assert all(s.selections > 0 for s in seen[-1])  # 64 kept tokens over a 16-token budget: it selected
    assert len(hooked) == sum(len(sel) for sel in seen)
    assert row["tokens_per_s"] == pytest.approx(2 / row["tpot_s"])


def test_prefill_flops_by_hand(tiny):
    c = tiny.config  # hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, head dim 16
    per_token = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    attention = 2 * 4 * 4 * 16 * (3 * 10 + 3 * 4 / 2)  # 3 new tokens after 10 kept
    assert hardware.prefill_flops(c, 3, history=10) == 2 * per_token * 3 + 2 * 64 * c.vocab_size + attention


def test_prefill_floor_is_the_longer_of_compute_and_reads(tiny):
    """A long prompt is bound by its FLOPs, a short turn by reading the weights and the KV it attends."""
    c = tiny.config
    kv = 2 * 2 * 16 * 4  # K and V, 2 layers x 2 KV heads x head dim 16, fp32
    hw = {"matmul_rate": 1e12, "copy_bandwidth": 1e12, "weight_bytes": 10**8}
    long = hardware.prefill_floor(c, hw, kv, 4096)
    assert long == pytest.approx(hardware.prefill_flops(c, 4096) / 1e12)
    short = hardware.prefill_floor(c, hw, kv, 2, history=1000)
    assert short == pytest.approx((10**8 + 1002 * kv) / 1e12)
    assert short > hardware.prefill_flops(c, 2, history=1000) / 1e12


def test_run_speed_measures_every_planned_figure(tiny, tmp_path):
    # 16 new tokens: the peer's time per token is T(16) - T(1), which must stand clear of timer noise.
    cfg = SpeedConfig(contexts=[24, 48], batches=[1, 2], new_tokens=16, turns=2, turn_tokens=(8, 3),
                      recipes={"full": Recipe(), "snapkv": Recipe.parse("snapkv budget=16")}, repeat=1)
    result = run_speed(tiny, cfg, progress=False)
    hw = result["hardware"]
    assert hw["copy_bandwidth"] > 0 and hw["matmul_rate"] > 0
    assert hw["weight_bytes"] == sum(p.numel() * 4 for p in tiny.model.parameters())
    rows = result["rows"]
    ours = [r for r in rows if r["engine"] == "turnkv" and "turns" not in r]
    assert len(ours) == 2 * 2 * 2  # recipes x contexts x batches
    for r in ours:
        assert r["tpot_s"] > 0 and r["tpot_floor_s"] > 0
        assert r["tpot_of_floor"] == pytest.approx(r["tpot_floor_s"] / r["tpot_s"])
    # SnapKV at 16 tokens per head holds less KV than the full cache at 48 tokens.
    kv = {(r["recipe"], r["context"], r["batch"]): r["kv_bytes"] for r in ours}
    assert kv[("snapkv", 48, 1)] < kv[("full", 48, 1)]
    batch2 = next(r for r in ours if (r["recipe"], r["context"], r["batch"]) == ("full", 48, 2))
    # The KV a last step reads: the prompt and every generated token but the last.
    assert batch2["kv_read_bytes"] == 2 * (48 + 15) * tiny.config.kv_bytes_per_token(4)
    turns = [r for r in rows if "turns" in r]
    # Each size over the same history; the history then grows by a turn of the first size.
    assert [(t["turn"], t["history_tokens"], t["new_tokens"]) for t in turns[0]["turns"]] == \
        [(2, 24, 8), (2, 24, 3), (3, 32, 8), (3, 32, 3)]
    assert all(t["prefill_s"] > 0 and t["floor_s"] > 0 for t in turns[0]["turns"])
    assert "reprefill_whole_history_s" in turns[0]["turns"][-1]
    hf = [r for r in rows if r["engine"] == "transformers"]
    assert len(hf) == 4 and all(r["tpot_s"] > 0 and r["ttft_s"] > 0 for r in hf)
    assert {r["context"] for r in rows if r["engine"] == "sdpa"} == {24, 48}
    assert tiny.pool.bytes_in_use() == tiny.prefix_cache_bytes()  # every measurement gave its pages back

    text = speed_report.write(result, tmp_path, "turnkv bench speed (test)")
    assert "| turnkv | snapkv | 48 | 1 |" in text and "Later turns" in text
    assert json.loads((tmp_path / "speed.json").read_text())["command"] == "turnkv bench speed (test)"
    assert (tmp_path / "tpot.png").stat().st_size > 0 and (tmp_path / "ttft.png").stat().st_size > 0


def test_plots_of_a_run_without_a_figure_are_drawn_without_warnings(tmp_path):
    import warnings

    result = {"model": "tiny", "hardware": {"device": "cpu"},
              "rows": [{"engine": "turnkv", "recipe": "full", "context": 24, "batch": 1, "tpot_s": 0.01}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty legend (ttft_s is missing) warns
        paths = speed_report.plots(result, tmp_path)
    assert [p.name for p in paths] == ["tpot.png", "ttft.png"] and all(p.stat().st_size > 0 for p in paths)


def test_a_peer_that_cannot_run_is_reported(tiny, monkeypatch):
    def unavailable(llm):
        raise peers.PeerUnavailable("transformers is not installed")

    monkeypatch.setattr(peers, "transformers_model", unavailable)
    result = run_speed(tiny, SpeedConfig(contexts=[16], new_tokens=2, turns=0, repeat=1), progress=False)
    row = next(r for r in result["rows"] if r["engine"] == "transformers")
    assert row["unavailable"] == "transformers is not installed"


def test_a_shape_past_the_kv_pool_is_reported_and_the_rest_runs(chat_model_dir):
    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64KiB")  # about 128 tokens
    result = run_speed(small, SpeedConfig(contexts=[16, 400], new_tokens=2, turns=0, repeat=1, peers=[]),
                       progress=False)
    by_context = {r["context"]: r for r in result["rows"]}
    assert by_context[16]["tpot_s"] > 0
    assert by_context[400]["unavailable"].startswith("KV pool full")
    assert small.pool.bytes_in_use() == small.prefix_cache_bytes()


def test_batched_rows_count_what_a_quantized_pool_reads(chat_model_dir):
    """With int8 KV the floor's KV read is the codes and their scales: (2 x 16 + 2 x 4) bytes per
    token-head of the tiny model (head_dim 16), against 2 x 16 x 4 in fp32."""
    from turnkv.bench.speed import measure

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", kv_dtype="int8")
    cfg = SpeedConfig(contexts=[48], batches=[2], new_tokens=4, turns=0, repeat=1)
    hw = {"weight_bytes": 1000, "copy_bandwidth": 1e9, "matmul_rate": 1e12}
    row = measure(llm, Recipe(), 48, 2, cfg, hw)
    assert row["kv_read_bytes"] == 2 * (48 + 3) * 2 * 2 * (2 * 16 + 2 * 4)
    assert row["tpot_floor_s"] == pytest.approx((1000 + row["kv_read_bytes"]) / 1e9)


def test_decode_floor_counts_what_a_selection_reads(tiny):
    """The floor's KV read: every kept byte without a selection; with LoopServe's, the budget plus
    half an interval per query-head row, and every key once per re-selection (by hand, tiny shape:
    2 layers, 4 query heads, 2 KV heads, head dim 16, fp32)."""
    from turnkv.bench.floors import decode_kv_read_bytes

    c = tiny.config
    assert decode_kv_read_bytes(Recipe.parse("snapkv budget=16"), c, 4, 1000, 12345) == 12345
    loop = Recipe.parse("loopserve-d decode=loopserve(budget=64,interval=16)")
    selected = 2 * 4 * (64 + 8) * (2 * 16 * 4)
    rescoring = 1000 * 2 * 2 * 16 * 4 / 16
    assert decode_kv_read_bytes(loop, c, 4, 1000, 10**9) == pytest.approx(selected + rescoring)
    quest = Recipe.parse("decode=quest(budget=64,dense_layers=0)")
    assert decode_kv_read_bytes(quest, c, 4, 4096, 10**9) < 4096 * c.kv_bytes_per_token(4)


def test_steady_time_per_token_spans_the_steps_after_the_skipped_tokens():
    from types import SimpleNamespace

    from turnkv.bench.speed import steady_time_per_token

    # Token k read at 0.1 * k seconds, except a slow first decode step (a graph capture).
    times = [0.0, 5.0] + [5.0 + 0.1 * k for k in range(1, 63)]
    reply = SimpleNamespace(token_times=times, time_per_token_s=-1.0)
    assert steady_time_per_token(reply, 16) == pytest.approx(0.1)  # steps 16..63: 48 steps
    assert steady_time_per_token(reply, 0) == -1.0 and steady_time_per_token(reply, 64) == -1.0


def test_each_row_is_written_as_it_finishes_and_a_stopped_run_resumes(tiny, tmp_path, monkeypatch):
    from turnkv.bench import speed
    from turnkv.errors import InvalidRequestError

    cfg = SpeedConfig(contexts=[16, 24], batches=[1], new_tokens=3, turns=0, repeat=1, peers=("sdpa",),
                      recipes={"full": Recipe(), "snapkv": Recipe.parse("snapkv budget=8")})
    rows_path = tmp_path / "run" / "rows.jsonl"
    measure, measured = speed.measure, []

    def stopped_at_the_third(llm, recipe, ctx, batch, cfg, hw):
        if len(measured) == 2:
            raise KeyboardInterrupt  # the run is killed while it measures its third row
        measured.append((str(recipe), ctx))
        return measure(llm, recipe, ctx, batch, cfg, hw)

    monkeypatch.setattr(speed, "measure", stopped_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        run_speed(tiny, cfg, progress=False, rows_path=rows_path)
    kept = [json.loads(line) for line in rows_path.read_text().splitlines()]
    assert len(kept) == 1 + 2 and kept[1]["row"]["tpot_s"] > 0  # the settings, then the two finished rows

    def counted(llm, recipe, ctx, batch, cfg, hw):
        measured.append((str(recipe), ctx))
        return measure(llm, recipe, ctx, batch, cfg, hw)

    monkeypatch.setattr(speed, "measure", counted)
    result = run_speed(tiny, cfg, progress=False, rows_path=rows_path)
    assert measured[2:] == [(str(Recipe.parse("snapkv budget=8")), 16), (str(Recipe.parse("snapkv budget=8")), 24)]
    ours = [r for r in result["rows"] if r["engine"] == "turnkv"]
    assert [(r["recipe"], r["context"]) for r in ours] == [("full", 16), ("full", 24), ("snapkv", 16), ("snapkv", 24)]
    assert ours[:2] == [k["row"] for k in kept[1:]]  # the rows of the stopped run, as they were measured
    assert result["hardware"] == kept[0]["hardware"] and len([r for r in result["rows"] if r["engine"] == "sdpa"]) == 2
    # A rerun measures nothing; other settings over the same file are refused, not mixed in.
    run_speed(tiny, cfg, progress=False, rows_path=rows_path)
    assert len(measured) == 4
    with pytest.raises(InvalidRequestError, match="other settings"):
        run_speed(tiny, SpeedConfig(**{**vars(cfg), "new_tokens": 4}), progress=False, rows_path=rows_path)


def test_median_time_runs_the_undo_after_every_call_outside_the_clock():
    calls = []

    def slow_undo():
        calls.append("undo")
        time.sleep(0.05)

    seconds = hardware.median_time(lambda: calls.append("run"), torch.device("cpu"), repeat=3, warmup=1,
                                   after=slow_undo)
    assert calls == ["run", "undo"] * 4  # the warm-up too: every timed call starts from the same state
    assert seconds < 0.01  # the 50 ms undo is not on the clock


def test_every_timed_prefill_has_lengths_no_earlier_call_had(tiny, monkeypatch):
    """A conversation's lengths do not repeat, so neither do the benchmark's: each timed turn runs over a
    history a token shorter than the last (then the history is put back), and each TTFT run's prompt is
    a token shorter than the last."""
    from turnkv.bench.speed import measure, measure_turns

    calls = []
    prefill = tiny.runner.prefill

    def spy_prefill(seq, ids, *args, **kwargs):
        calls.append((seq.next_position, len(ids)))
        return prefill(seq, ids, *args, **kwargs)

    monkeypatch.setattr(tiny.runner, "prefill", spy_prefill)
    cfg = SpeedConfig(contexts=[24], new_tokens=4, turns=2, turn_tokens=(8, 3), repeat=3, peers=())
    rows = measure_turns(tiny, 24, cfg, {"matmul_rate": 1e12, "copy_bandwidth": 1e11, "weight_bytes": 1})
    assert [(r["history_tokens"], r["new_tokens"]) for r in rows] == [(24, 8), (24, 3), (32, 8), (32, 3)]
    # The first turn: the 24-token history, two untimed calls and three timed ones, each over a shorter
    # history, then the 5 rolled-back tokens again; the same for 3 new tokens; then the turn kept.
    assert calls[:15] == [(0, 24), (24, 8), (23, 8), (22, 8), (21, 8), (20, 8), (19, 5),
                          (24, 3), (23, 3), (22, 3), (21, 3), (20, 3), (19, 5), (24, 8), (32, 8)]
    lengths = []
    generate = tiny.generate

    def spy(prompts, **kwargs):
        lengths.append([len(p) for p in prompts] if isinstance(prompts[0], list) else "warm-up")
        return generate(prompts, **kwargs)

    monkeypatch.setattr(tiny, "generate", spy)
    measure(tiny, tiny.recipe, 40, 1, cfg, {"matmul_rate": 1e12, "copy_bandwidth": 1e11, "weight_bytes": 1})
    assert lengths == ["warm-up", [40], [39], [38]]


def test_a_history_shorter_than_the_timed_calls_still_measures(tiny):
    """Three tokens of history and five calls: the rollbacks stop at an empty history, then the whole
    history is prefilled again, and the next turn's row starts from it."""
    from turnkv.bench.speed import measure_turns

    cfg = SpeedConfig(contexts=[3], new_tokens=2, turns=2, turn_tokens=4, repeat=3, peers=())
    rows = measure_turns(tiny, 3, cfg, {"matmul_rate": 1e12, "copy_bandwidth": 1e11, "weight_bytes": 1})
    assert [(r["history_tokens"], r["new_tokens"]) for r in rows] == [(3, 4), (7, 4)]
    assert all(r["prefill_s"] > 0 for r in rows)
