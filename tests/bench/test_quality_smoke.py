"""The CI smoke subset: `turnkv bench quality --preset smoke` on the embedded SmolLM2 (about two
minutes on 2 CPU cores). Every task and question position, SnapKV under both turn policies, the
report written. It checks that the suite runs end to end and that its invariants hold, not scores."""

from __future__ import annotations

import json

import pytest

from turnkv.bench.quality_presets import PRESETS
from turnkv.cli import main


@pytest.mark.slow
def test_bench_quality_smoke_preset_on_smollm2(tmp_path):
    out = tmp_path / "q"
    assert main(["bench", "quality", "--preset", "smoke", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    preset = PRESETS["smoke"]
    tasks = preset["tasks"].split(",")
    positions = preset["positions"].split(",")
    recipes = {"full", "snapkv@recompress", "snapkv@flowkv"}
    assert {r["task"] for r in records} == set(tasks) and {r["position"] for r in records} == set(positions)
    assert {r["recipe"] for r in records} == recipes
    assert len(records) == len(tasks) * len(positions) * len(recipes) * preset["turns"]  # every turn recorded
    full = [r for r in records if r["recipe"] == "full"]
    assert all(r["agreement"] == 1.0 and r["kl"] == 0.0 and r["first_divergence"] is None for r in full)
    for name in recipes - {"full"}:
        evicting = [r for r in records if r["recipe"] == name]
        assert all(r["kv_bytes"] <= r["full_kv_bytes"] for r in evicting)
        assert any(r["kv_bytes"] < r["full_kv_bytes"] for r in evicting)  # the budget really bit
        assert any(r["kl"] > 0 for r in evicting) and all(0.0 <= r["agreement"] <= 1.0 for r in evicting)
    summary = json.loads((out / "summary.json").read_text())
    assert {r["recipe"] for r in summary["by_recipe"]} == recipes
    assert "--preset smoke" in summary["command"] or summary["settings"]["preset"] == "smoke"
    report = (out / "report.md").read_text()
    assert "| snapkv@flowkv |" in report and "## By question position" in report
