"""The quality runner: full-cache fidelity to itself, per-turn records, resume, determinism, reports."""

from __future__ import annotations

import json

import pytest

from turnkv.bench.datasets.schema import Instance, Turn
from turnkv.bench.quality import QualityConfig, run_quality
from turnkv.bench.report import write_report
from turnkv.bench.scoring import score_turn

DOC = "\n\n".join(f"Paragraph {i}: the harbour keeper logged ship number {100 + i} at dawn." for i in range(8))


def instances():
    turns = [Turn(DOC, "Which ship did the keeper log in paragraph 3?", "103", metric="contains"),
             Turn(DOC.replace("ship", "boat"), "And in paragraph 5 of the first text?", ["105"], depends_on=[0],
                  metric="contains"),
             Turn("", "Answer with A or B: was the first text about (A) ships or (B) trains?", "A", depends_on=[0],
                  metric="accuracy")]
    return [Instance("harbour", "h0", turns, system="Answer briefly.")]


def test_every_turn_is_recorded_and_full_is_faithful_to_itself(chat_llm, tmp_path):
    config = QualityConfig(recipes={"snap": "snapkv budget=8"}, positions=("begin", "middle", "end"),
                           max_new_tokens=6)
    records = run_quality(chat_llm, instances(), config, tmp_path / "r.jsonl", progress=False)
    assert len(records) == 3 * 2 * 3  # positions x recipes x turns
    full = [r for r in records if r["recipe"] == "full"]
    assert all(r["agreement"] == 1.0 and r["kl"] == 0.0 and r["first_divergence"] is None for r in full)
    assert all(r["kv_bytes"] == r["full_kv_bytes"] for r in full)
    snap = [r for r in records if r["recipe"] == "snap"]
    assert all(0.0 <= r["agreement"] <= 1.0 and r["kl"] >= 0.0 for r in snap)
    # turn 0 of a conversation without history to compress is identical; later turns hold less KV
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for r in snap if r["turn"] > 0)
    assert {r["position"] for r in records} == {"begin", "middle", "end"}
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()


def test_resume_skips_what_is_done_and_reproduces_it(chat_llm, tmp_path):
    path = tmp_path / "r.jsonl"
    config = QualityConfig(recipes={"snap": "snapkv budget=8"}, positions=("end",), max_new_tokens=5)
    first = run_quality(chat_llm, instances(), QualityConfig({}, ("end",), 5), path, progress=False)
    assert len(first) == 3 and len(path.read_text().splitlines()) == 3
    both = run_quality(chat_llm, instances(), config, path, progress=False)
    assert len(path.read_text().splitlines()) == 6 and len(both) == 6
    again = run_quality(chat_llm, instances(), config, path, progress=False)
    assert len(path.read_text().splitlines()) == 6  # nothing recomputed
    fresh = run_quality(chat_llm, instances(), config, tmp_path / "fresh.jsonl", progress=False)
    key = lambda r: (r["recipe"], r["turn"])  # noqa: E731
    assert [r["tokens"] for r in sorted(again, key=key)] == [r["tokens"] for r in sorted(fresh, key=key)]


def test_report_tables_and_plots(chat_llm, tmp_path):
    config = QualityConfig(recipes={"snap": "snapkv budget=8"}, positions=("begin", "end"), max_new_tokens=4)
    records = run_quality(chat_llm, instances(), config, tmp_path / "r.jsonl", progress=False)
    summary = write_report(records, tmp_path, {"model": "tiny", "command": "test", "settings": {}})
    by_recipe = {r["recipe"]: r for r in summary["by_recipe"]}
    assert by_recipe["full"]["agreement"] == 1.0 and by_recipe["full"]["kv_ratio"] == 1.0
    assert by_recipe["snap"]["n"] == 6 and by_recipe["snap"]["kv_ratio"] < 1.0
    report = (tmp_path / "report.md").read_text()
    assert "## By question position" in report and "| snap |" in report
    for plot in ("score_vs_kv.png", "per_position.png", "per_turn.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["model"] == "tiny"


@pytest.mark.parametrize("metric,response,answer,expected", [
    ("contains", "It was ship 103, I think.", "103", 1.0),
    ("contains", "It was ship 104.", "103", 0.0),
    ("em", "The Paris.", "paris", 1.0),
    ("f1", "Paris France", "Paris", 2 * 0.5 / 1.5),
    ("accuracy", "B) trains", "B", 1.0),
    ("accuracy", "The answer is (A).", "B", 0.0),
])
def test_scoring_by_metric(metric, response, answer, expected):
    assert score_turn(Turn("", "q", answer, metric=metric), response) == pytest.approx(expected)


def test_question_positions_in_the_message():
    turn = Turn("first part.\n\nsecond part.", "QUESTION?", "x")
    assert turn.message().endswith("QUESTION?")
    assert Turn(turn.context, "QUESTION?", "x", position="begin").message().startswith("QUESTION?")
    middle = Turn(turn.context, "QUESTION?", "x", position="middle").message()
    assert middle == "first part.\n\nQUESTION?\n\nsecond part."


def test_unknown_instruction_kinds_are_not_scored():
    turn = Turn("", "q", "", metric="instructions", instructions=[{"kind": "lowercase"}, {"kind": "no_such_rule"}])
    assert score_turn(turn, "all lower case") == 1.0 and score_turn(turn, "Not Lower") == 0.0
    assert score_turn(Turn("", "q", "", metric="instructions", instructions=[{"kind": "no_such_rule"}]), "x") is None


def test_a_sparse_prefill_records_its_density_and_every_turn_its_ttft(chat_llm, tmp_path):
    config = QualityConfig(recipes={"ashape": "prefill=a_shape(sink=4, local=16)"}, positions=("end",),
                           max_new_tokens=3, fidelity=False)
    records = run_quality(chat_llm, instances(), config, tmp_path / "r.jsonl", progress=False)
    by = {(r["recipe"], r["turn"]): r for r in records}
    assert all(r["ttft_s"] > 0 and r["prefilled_tokens"] > 0 for r in records)
    assert all("density" not in r for r in records if r["recipe"] == "full")
    # The first prompt is far longer than 4 + 16 tokens: a small share of its causal cells is computed.
    assert 0.0 < by[("ashape", 0)]["density"] < 0.5
    summary = write_report(records, tmp_path, {"model": "tiny", "command": "test", "settings": {}})
    row = next(r for r in summary["by_recipe"] if r["recipe"] == "ashape")
    assert row["density"] == pytest.approx(sum(by[("ashape", t)]["density"] for t in range(3)) / 3)
    assert "| prefill density | TTFT s |" in (tmp_path / "report.md").read_text()
