"""The turnkv command: piped multi-turn chat with per-turn stats, /stats and /reset, generate, info,
and clear errors."""

from __future__ import annotations

import io
import json
import re

import pytest

from turnkv.cli import main


def run_cli(monkeypatch, capsys, argv, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_piped_chat_keeps_the_conversation_and_prints_stats(monkeypatch, capsys, chat_model_dir):
    stdin = "Hello there.\n/stats\nAnd again?\n/reset\nFresh start.\n"
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "4",
                                                   "--kv-memory", "32MiB"], stdin)
    assert code == 0, err
    stats = re.findall(r"\[(\d+) new \+ (\d+) reused tokens \| KV ([\d.]+) MB", out)
    assert len(stats) == 3
    (new1, reused1, _), (new2, reused2, _), (new3, reused3, _) = [tuple(map(float, s)) for s in stats]
    assert reused1 == 0 and reused2 > new1 and reused3 == 0  # turn 2 reused turn 1's KV; /reset cleared it
    assert "turns: 1" in out and "KV held:" in out and "(conversation reset)" in out


def test_chat_reports_bad_turns_and_goes_on(monkeypatch, capsys, chat_model_dir):
    stdin = "x " * 600 + "\nShort one.\n"
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                   "--kv-memory", "32MiB"], stdin)
    assert code == 0 and "error:" in err and "context" in err
    assert len(re.findall(r"reused tokens", out)) == 1


def test_generate_and_info(monkeypatch, capsys, chat_model_dir):
    code, out, err = run_cli(monkeypatch, capsys, ["generate", "Once upon", "--model", str(chat_model_dir),
                                                   "--max-new-tokens", "5", "--kv-memory", "32MiB"])
    assert code == 0 and "new + 0 reused tokens" in err
    code, out, _ = run_cli(monkeypatch, capsys, ["info", "--json", "--model", str(chat_model_dir), "--kv-memory", "32MiB"])
    info = json.loads(out)
    assert code == 0 and info["kv_heads"] == 2 and info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_errors_exit_with_a_message(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, ["info", "--model", str(tmp_path / "missing.gguf")])
    assert code == 2 and "not found" in err
    code, _, err = run_cli(monkeypatch, capsys, ["info", "--model", "smollm2-135m", "--dtype", "float8"])
    assert code == 2 and "unknown dtype" in err
    with pytest.raises(SystemExit):
        main(["chat", "--temperature", "hot"])
