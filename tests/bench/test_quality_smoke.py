"""The CI smoke subset: `turnkv bench quality --preset smoke` on the embedded SmolLM2 (about two
minutes on 2 CPU cores). Every task and question position, SnapKV under both turn policies, the
report written. It checks that the suite runs end to end, that its invariants hold, and that its
greedy records are the committed snapshot's (snapshots/quality_smoke.jsonl): a change to the engine's
turn or step path that changes what the smoke run computes shows up here.

To refresh the snapshot after a deliberate change of behaviour:
    turnkv bench quality --preset smoke --out /tmp/smoke
    python tests/bench/test_quality_smoke.py /tmp/smoke/results.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from turnkv.bench.quality_presets import PRESETS
from turnkv.cli import main

SNAPSHOT = Path(__file__).parent / "snapshots" / "quality_smoke.jsonl"
# What a record holds that the engine computes deterministically (timings are left out).
EXACT = ("instance", "task", "position", "recipe", "turn", "tokens", "response", "score", "kv_bytes",
         "full_kv_bytes", "history_tokens", "first_divergence", "prefilled_tokens", "agreement")


def snapshot_of(records: list[dict]) -> list[dict]:
    rows = [{k: r[k] for k in (*EXACT, "kl") if k in r} for r in records]
    return sorted(rows, key=lambda r: (r["instance"], r["recipe"], r["turn"]))


@pytest.mark.slow
def test_bench_quality_smoke_preset_on_smollm2(tmp_path, embedded_model):
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
    expected = [json.loads(line) for line in SNAPSHOT.read_text().splitlines()]
    got = snapshot_of(records)
    assert len(got) == len(expected)
    for row, want in zip(got, expected):
        assert {k: row.get(k) for k in EXACT} == {k: want.get(k) for k in EXACT}
        # KL of nearly equal distributions is fp32 rounding, which the BLAS thread count changes; the
        # KLs that tell recipes apart are orders of magnitude above the tolerance.
        assert row["kl"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-5)


if __name__ == "__main__":  # write the snapshot from a smoke run's results.jsonl
    lines = Path(sys.argv[1]).read_text().splitlines()
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text("".join(json.dumps(r) + "\n" for r in snapshot_of([json.loads(x) for x in lines])))
