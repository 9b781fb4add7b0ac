"""benchmarks/scoreboard/scoreboard.py: one engine, every system's headline cells, each cell's two figures
read from the same run's measurements, the table, and the table docs/benchmarks.md shows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "scoreboard"))

import score_cells as cells  # noqa: E402
import score_table as table  # noqa: E402
from score_claims import SERVING  # noqa: E402
import scoreboard  # noqa: E402

SMALL = ["--device", "cpu", "--contexts", "48,96", "--krul-history", "256", "--turn-tokens", "24", "--new-tokens", "6",
         "--repeat", "1"]


@pytest.fixture(scope="module")
def board(chat_model_dir, tmp_path_factory):
    """A whole CPU run on a tiny random llama with SmolLM2's tokenizer and chat template."""
    out = tmp_path_factory.mktemp("board") / "board.json"
    assert scoreboard.main(["--model", str(chat_model_dir), *SMALL, "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_every_planned_measurement_is_taken_once_on_the_one_engine(board):
    _, result = board
    settings = cells.Settings((48, 96), 24, result["settings"]["turn_history"], 256)
    planned = cells.plan(list(cells.SYSTEMS), settings)
    keys = [cells.key(*p) for p in planned]
    assert list(result["measurements"]) == keys and len(set(keys)) == len(keys)
    assert not result["skipped"]
    for key, row in result["measurements"].items():
        assert "unavailable" not in row, (key, row)
        assert row["ttft_s"] > 0, key
    assert result["measurements"]["speed|full|96"]["context"] == 96
    turn = result["measurements"][f"turn|full|{settings.turn_history}"]
    assert turn["history_tokens"] >= settings.turn_history and len(turn["ttft_all"]) == 1
    assert result["measurements"]["restore|krul|256"]["history_tokens"] == 256


def test_each_cell_reads_both_figures_from_this_run_and_divides_them(board):
    _, result = board
    measured = result["measurements"]
    systems = {c["system"] for c in result["cells"]}
    assert systems == {"LServe", "LoopServe", "Ada-KV", "Krul", "FlowKV"} == set(result["claims"])
    assert len(result["cells"]) == 2 + 2 + 3 + 2 + 3 + 1
    for cell in result["cells"]:
        if cell.get("source"):
            continue
        mine, base = cell["turnkv"], cell["baseline"]
        assert mine["value"] == measured[mine["key"]][cell["field"]], cell["figure"]
        assert base["value"] == measured[base["key"]][cell["field"]], cell["figure"]
        lower = cell["field"] != "agreement"
        assert cell["x"] == pytest.approx(base["value"] / mine["value"] if lower else mine["value"] / base["value"])
        assert cell["met"] == (None if cell["goal"] is None else cell["x"] >= cell["goal"])
    lserve = [c for c in result["cells"] if c["system"] == "LServe"]
    assert [c["baseline"]["key"] for c in lserve[:2]] == ["speed|full|48", "speed|full|96"]
    krul = [c for c in result["cells"] if c["system"] == "Krul"]
    assert [c["baseline"]["label"] for c in krul] == ["recompute", "full", "full"]
    fallback = measured["restore|krul|256"]["fallback"]  # random weights: no layer pairs, so a plainer store
    assert all(c.get("note") == (f"Krul stored it as {fallback}" if fallback else None) for c in krul)


def test_flowkv_is_read_from_the_committed_quality_run_and_says_so(board):
    _, result = board
    (cell,) = [c for c in result["cells"] if c["system"] == "FlowKV"]
    summary = json.loads((REPO / "benchmarks/quality/results/smollm2-hour/summary.json").read_text())
    last = max(r["turn"] for r in summary["by_turn_recipe"])
    rows = {r["recipe"]: r["agreement"] for r in summary["by_turn_recipe"] if r["turn"] == last}
    assert cell["source"] == "from benchmarks/quality/results/smollm2-hour/summary.json"
    assert cell["turnkv"]["value"] == rows["snapkv@flowkv@0.2"]
    assert cell["baseline"]["value"] == rows["snapkv@recompress@0.2"]
    assert cell["x"] == pytest.approx(rows["snapkv@flowkv@0.2"] / rows["snapkv@recompress@0.2"])


def test_the_table_is_written_beside_the_json_and_shows_every_cell(board):
    out, result = board
    text = out.with_suffix(".md").read_text()
    assert text == table.markdown(result)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(result["cells"])
    for cell, line in zip(result["cells"], lines[1:]):
        assert cell["figure"] in line and f"{cell['x']:.2f}x" in line
    for claim in result["claims"].values():
        assert claim in text
    for path in SERVING.values():  # the committed serving runs the table points to
        assert path in text and (REPO / path).exists()


def test_markdown_mode_puts_the_table_into_a_page(board, tmp_path, capsys):
    out, result = board
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- scoreboard: old.json -->\nold table\n<!-- /scoreboard -->\n\nafter\n")
    assert scoreboard.main(["--markdown", str(out), "--page", str(page)]) == 0
    assert capsys.readouterr().out == table.markdown(result)
    assert table.shown_in_page(page) == (str(out), table.markdown(result))
    assert page.read_text().endswith("<!-- /scoreboard -->\n\nafter\n")
    plain = tmp_path / "plain.md"
    plain.write_text("# A page without a scoreboard block\n")
    with pytest.raises(ValueError, match="no lines"):
        table.put_in_page(plain, "a.json", "table")


def test_ratios_follow_the_numbers_given(tmp_path):
    """No figure is built in: the cells divide whatever the measurements hold."""
    s = cells.Settings((100, 200), 10, 150, 300)
    measured = {cells.speed_key("full", 200): {"ttft_s": 3.0, "tpot_s": 0.02, "kv_bytes": 1000},
                cells.speed_key("lserve-random", 200): {"ttft_s": 1.5, "tpot_s": 0.01, "kv_bytes": 500},
                cells.speed_key("lserve-random", 100): {"unavailable": "KV pool full: ..."}}
    out = {c["figure"]: c for c in cells.cells(measured, ["lserve"], s)}
    assert out["prefill TTFT, 200-token prompt"]["x"] == 2.0
    assert out["decode at 200 tokens, time per token"]["x"] == 2.0
    assert out["decode at 200 tokens, time per token"]["met"] is True  # the goal is 1.8x
    short = out["prefill TTFT, 100-token prompt"]
    assert short["x"] is None and short["met"] is None and "KV pool full" in short["missing"]
    turn = out["10-token later turn over 150 tokens kept, TTFT"]
    assert turn["x"] is None and turn["missing"] == "turn|lserve-random|150 was not measured"


def test_a_subset_plans_only_what_its_cells_read():
    s = cells.Settings((100, 200), 10, 150, 300)
    assert cells.plan(["adakv"], s) == [("speed", "full", 200), ("speed", "ada-snapkv keep_ratio=0.1", 200)]
    plan = cells.plan(["lserve", "loopserve"], s)
    assert plan[:2] == [("speed", "full", 100), ("speed", "lserve-random", 100)]
    assert plan[2][1] == "full" and sum(p == ("speed", "full", 200) for p in plan) == 1
    assert plan[-2:] == [("turn", "full", 150), ("turn", "lserve-random", 150)]


@pytest.mark.parametrize("bad", [["--cells", "lserve,h2o"], ["--contexts", "8"], ["--contexts", "a,b"],
                                 ["--repeat", "0"]])
def test_bad_options_are_refused_before_anything_loads(bad, capsys):
    with pytest.raises(SystemExit):
        scoreboard.parse(bad)
    assert "--" in capsys.readouterr().err


def test_the_engine_is_built_once_with_room_for_the_longest_row(monkeypatch):
    """Its pool holds the longest prompt with its decode and later turns (or Krul's conversation, if
    longer); the tokenizer and the CPU tier are passed through."""
    from turnkv.model.config import SHAPES

    built = []
    monkeypatch.setattr(scoreboard, "LLM", lambda model, **kw: built.append((model, kw)))
    scoreboard.build_engine(scoreboard.parse(["--model", "llama-3.1-8b", "--device", "cpu", "--tokenizer", "tok",
                                              "--contexts", "1000,4000", "--krul-history", "2048"]))
    (model, kw), = built
    tokens = 4000 + 64 + (2 + 2 + 1) * (512 + 64)
    assert model == "llama-3.1-8b" and kw["tokenizer"] == "tok" and kw["max_model_len"] == tokens
    assert kw["state_cpu_memory"] == "1GiB" and kw["device"] == "cpu"
    config = SHAPES["llama-3.1-8b"]
    per_token = config.num_layers * config.num_kv_heads * config.head_dim * 2 * 2  # K and V, bf16
    assert kw["kv_memory"](config, torch.bfloat16) == int(tokens * per_token * 1.1) + (64 << 20)


def test_without_a_chat_template_the_chat_cells_are_left_out_with_the_reason(tmp_path):
    from conftest import save_tiny

    save_tiny(tmp_path / "m", "llama")
    out = tmp_path / "b.json"
    scoreboard.main(["--model", str(tmp_path / "m"), *SMALL, "--cells", "krul", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["measurements"] == {}
    assert set(result["skipped"]) == {"restore|full|256", "restore|recompute|256", "restore|krul|256"}
    assert all(c["x"] is None and "not measured" in c["missing"] for c in result["cells"])


def test_the_docs_show_the_table_of_the_json_they_name():
    shown = table.shown_in_page(REPO / "docs" / "benchmarks.md")
    assert shown is not None, "docs/benchmarks.md has no scoreboard block"
    path, text = shown
    result = json.loads((REPO / path).read_text())
    assert text == table.markdown(result), \
        f"rerun: python benchmarks/scoreboard/scoreboard.py --markdown {path} --page docs/benchmarks.md"
    # Its cells are what the scoreboard makes of its own measurements: nothing edited in by hand.
    s = result["settings"]
    settings = cells.Settings(tuple(s["contexts"]), s["turn_tokens"], s["turn_history"], s["krul_history"])
    again = cells.cells(result["measurements"], s["cells"], settings)
    assert [c for c in again if not c.get("source")] == [c for c in result["cells"] if not c.get("source")]
