"""The command line's --tensor-parallel: `turnkv chat` and `turnkv bench speed` at N=2 (gloo on CPU) give
N=1's replies; `turnkv serve` builds the engine at N=2 (tests/parallel/test_serve_parallel.py serves it)."""

from __future__ import annotations

import json

import pytest

from tests.parallel.conftest import TIMEOUT_S
from tests.test_cli import run_cli


@pytest.fixture
def tp_timeout(monkeypatch):
    monkeypatch.setenv("TURNKV_TP_TIMEOUT", TIMEOUT_S)


def _chat(monkeypatch, capsys, model, n):
    return run_cli(monkeypatch, capsys, ["chat", "--model", str(model), "--device", "cpu", "--max-new-tokens", "6",
                                         "--kv-memory", "16MiB", "--tensor-parallel", str(n)],
                   "Hello there.\n/stats\nAnd again?\n")


def test_chat_runs_turns_split_over_two_ranks(monkeypatch, capsys, chat_model_dir, tp_timeout):
    code, out, err = _chat(monkeypatch, capsys, chat_model_dir, 2)
    assert code == 0, err
    code1, out1, err1 = _chat(monkeypatch, capsys, chat_model_dir, 1)
    assert code1 == 0, err1
    replies = [line for line in out.splitlines() if not line.startswith(("[", "turns:", "KV", "per layer", "pool",
                                                                          "recipe", "state"))]
    replies1 = [line for line in out1.splitlines() if not line.startswith(("[", "turns:", "KV", "per layer", "pool",
                                                                            "recipe", "state"))]
    assert replies == replies1 and len(replies) >= 2  # the same greedy replies, turn after turn
    assert out.count(" reused tokens |") == 2 and "turns: 1" in out


def _speed(monkeypatch, capsys, model, out, n):
    code, _, err = run_cli(monkeypatch, capsys, [
        "bench", "speed", "--model", str(model), "--device", "cpu", "--contexts", "40", "--new-tokens", "6",
        "--turns", "1", "--turn-tokens", "8", "--repeat", "1", "--skip-tokens", "2", "--recipes", "full,snapkv budget=16",
        "--peers", "sdpa", "--out", str(out), "--tensor-parallel", str(n)])
    assert code == 0, err
    return json.loads((out / "speed.json").read_text())


def test_bench_speed_times_the_split_engine_on_rank_zero(monkeypatch, capsys, chat_model_dir, tmp_path, tp_timeout):
    pair = _speed(monkeypatch, capsys, chat_model_dir, tmp_path / "n2", 2)
    single = _speed(monkeypatch, capsys, chat_model_dir, tmp_path / "n1", 1)
    assert pair["tensor_parallel"] == 2 and pair["devices"] == ["cpu", "cpu"]
    assert single["tensor_parallel"] == 1 and single["devices"] == ["cpu"]
    ours = {r["recipe"]: r for r in pair["rows"] if r["engine"] == "turnkv" and "turns" not in r}
    ours1 = {r["recipe"]: r for r in single["rows"] if r["engine"] == "turnkv" and "turns" not in r}
    assert set(ours) == {"full", "snapkv budget=16"}
    for name, row in ours.items():
        assert row["tpot_s"] > 0 and row["ttft_s"] > 0
        assert row["reply_tokens"] == ours1[name]["reply_tokens"] and len(row["reply_tokens"]) == 6
    turns = next(r for r in pair["rows"] if "turns" in r)["turns"]
    assert turns and all(t["prefill_s"] > 0 for t in turns) and "reprefill_whole_history_s" in turns[-1]
    peer = next(r for r in pair["rows"] if r["engine"] == "sdpa")
    assert "one device" in peer["unavailable"]
    assert "Tensor parallel over 2 ranks" in (tmp_path / "n2" / "report.md").read_text()


def test_serve_builds_the_split_engine(monkeypatch, capsys, chat_model_dir, tp_timeout):
    served = []
    monkeypatch.setattr("turnkv.cli.serve", lambda llm, *a, **k: served.append(llm.parallel.size))
    code, _, err = run_cli(monkeypatch, capsys, ["serve", "--model", str(chat_model_dir), "--device", "cpu",
                                                 "--kv-memory", "8MiB", "--port", "0", "--tensor-parallel", "2"])
    assert code == 0, err
    assert served == [2]


@pytest.mark.parametrize("argv", [["chat"], ["generate"], ["serve"], ["bench", "speed"]])
def test_help_names_the_flag(capsys, argv):
    from turnkv.cli import main

    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "--tensor-parallel N" in out and "devices" in out
