"""benchmarks/prefill/loopserve_smollm2.py on the CPU: a whole run on a tiny random llama with SmolLM2's
tokenizer and chat template (the script's code, not the figures), its JSON's fields, and the reference's
agreement with itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "prefill"))

import loopserve_smollm2 as bench  # noqa: E402

CONTEXT = 256


@pytest.fixture(scope="module")
def result(chat_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loopserve-smollm2") / "run.json"
    argv = ["--model", str(chat_model_dir), "--device", "cpu", "--context", str(CONTEXT), "--new-tokens", "4",
            "--repeat", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_the_json_holds_the_run_and_every_recipe_row(result):
    assert result["command"].startswith("python benchmarks/prefill/loopserve_smollm2.py --model ")
    assert result["device"] == "cpu" and result["device_name"].startswith("cpu")
    assert result["dtype"] == "float32"
    assert result["settings"] == {"context": CONTEXT, "new_tokens": 4, "repeat": 1,
                                  "recipes": ["full", "loopserve-p"], "prefill_chunk": 4096,
                                  "prefix_cache": False}
    # The prompt fills the context but for what a cut at a token boundary leaves, and every recipe's
    # conversation prefilled exactly the tokens it was sized to.
    assert CONTEXT - 8 <= result["prompt_tokens"] <= CONTEXT
    assert result["documents"][0] == "README.md" and all(d.startswith("docs/") for d in result["documents"][1:])
    assert [r["recipe"] for r in result["rows"]] == ["full", "loopserve-p"]
    for row in result["rows"]:
        assert row["prompt_tokens"] == result["prompt_tokens"]
        assert row["ttft_s"] > 0 and row["ttft_runs_s"] == [row["ttft_s"]]
        assert row["speedup"] == pytest.approx(result["rows"][0]["ttft_s"] / row["ttft_s"])
        assert 0 <= row["agreement"] <= 1 and row["kl"] >= -1e-6
        assert len(row["reply_tokens"]) == 4


def test_the_reference_agrees_with_itself(result):
    full = result["rows"][0]
    assert full["agreement"] == 1.0 and full["kl"] == pytest.approx(0.0, abs=1e-6)
    assert full["first_divergence"] is None and full["speedup"] == 1.0
    assert full["prefill"] is None  # a dense prefill leaves no pattern statistics


def test_loopserve_reports_its_decisions_and_the_target(result):
    p = result["rows"][1]["prefill"]
    assert p["method"] == "loopserve" and 0 < p["density"] <= 1
    layers = len(p["density_per_layer"])
    assert layers == 2 and len(p["dense_per_layer"]) == layers and len(p["lines_per_head_mean_per_layer"]) == layers
    assert all(0 <= d <= 1 for d in p["dense_per_layer"]) and 0 <= p["dense_share"] <= 1
    assert 0 < p["recovered_mass"] <= 1 + 1e-6
    target = result["target"]
    assert target["recipe"] == "loopserve-p" and target["reference"] == "full"
    assert target["measured_agreement"] == result["rows"][1]["agreement"]
    assert target["met"] == (target["measured_speedup"] >= 1.3 and target["measured_agreement"] >= 0.98)
    table = bench.table(result)
    assert "| loopserve-p |" in table and "target loopserve-p" in table


def test_the_message_is_the_docs_cut_at_a_token_then_the_question(smol_tokenizer):
    text, _ = bench.document()
    message, tokens = bench.build_message(smol_tokenizer, text, 300)
    assert message.endswith("\n\n" + bench.QUESTION)
    assert text.startswith(message.removesuffix("\n\n" + bench.QUESTION)[:200])
    assert tokens == bench.chat_tokens(smol_tokenizer, message) and 290 <= tokens <= 300
    with pytest.raises(ValueError):
        bench.build_message(smol_tokenizer, text, 20)  # the template and question alone are longer


def test_recipes_split_at_commas_outside_parentheses():
    from turnkv.methods.terms import split_recipe_list
    assert split_recipe_list("full, loopserve-p prefill=loopserve(alpha=0.9,samples=8),") == [
        "full", "loopserve-p prefill=loopserve(alpha=0.9,samples=8)"]
