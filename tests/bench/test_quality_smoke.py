"""A smoke run of `turnkv bench quality` on the embedded SmolLM2: every task, two positions, one
evicting recipe, with the report written."""

from __future__ import annotations

import json

import pytest

from turnkv.cli import main


@pytest.mark.slow
def test_bench_quality_smoke_on_smollm2(tmp_path, capsys):
    out = tmp_path / "q"
    code = main(["bench", "quality", "--recipes", "snapkv", "--budget", "24", "--positions", "begin,end",
                 "--turns", "2", "--n", "1", "--context-tokens", "120", "--max-new-tokens", "8", "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    tasks = {r["task"] for r in records}
    assert tasks == {"needle_qa", "kv_retrieval", "preferences", "instructions", "fewshot"}
    assert len(records) == 5 * 2 * 2 * 2  # tasks x positions x recipes x turns
    full = [r for r in records if r["recipe"] == "full"]
    assert all(r["agreement"] == 1.0 and r["kl"] == 0.0 and r["first_divergence"] is None for r in full)
    snap = [r for r in records if r["recipe"] == "snapkv"]
    assert all(r["kv_bytes"] <= r["full_kv_bytes"] for r in snap) and any(r["kl"] > 0 for r in snap)
    summary = json.loads((out / "summary.json").read_text())
    assert {r["recipe"] for r in summary["by_recipe"]} == {"full", "snapkv"}
    assert "| snapkv |" in (out / "report.md").read_text()
