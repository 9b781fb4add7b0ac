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


def test_kv_dtype_option(monkeypatch, capsys, chat_model_dir):
    code, out, _ = run_cli(monkeypatch, capsys, ["info", "--json", "--model", str(chat_model_dir), "--kv-memory", "32MiB",
                                                 "--kv-dtype", "int8"])
    info = json.loads(out)
    assert code == 0 and info["kv_dtype"] == "int8" and info["kv_bytes_per_token"] == 2 * 2 * (2 * 16 + 2 * 4)
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                   "--kv-memory", "32MiB", "--kv-dtype", "fp8"], "Hello.\n/stats\n")
    assert code == 0, err
    assert "KV fp8" in out
    code, _, err = run_cli(monkeypatch, capsys, ["info", "--model", str(chat_model_dir), "--kv-dtype", "int4"])
    assert code == 2 and "choose one of: int8, fp8, none" in err


def test_errors_exit_with_a_message(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, ["info", "--model", str(tmp_path / "missing.gguf")])
    assert code == 2 and "not found" in err
    code, _, err = run_cli(monkeypatch, capsys, ["info", "--model", "smollm2-135m", "--dtype", "float8"])
    assert code == 2 and "unknown dtype" in err
    with pytest.raises(SystemExit):
        main(["chat", "--temperature", "hot"])


def test_methods_lists_components_and_presets(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, ["methods", "--json"])
    rows = json.loads(out)
    names = {(r["kind"], r["name"]) for r in rows}
    for scorer in ("streaming_llm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "expected_attention", "random"):
        assert ("scorer", scorer) in names
    assert ("allocator", "adakv") in names and ("turns", "flowkv") in names and ("turns", "recompress") in names
    snap = next(r for r in rows if r["name"] == "snapkv")
    assert snap["params"] == {"window": 32, "kernel": 5, "pooling": "avg", "compat": "authors"}
    code, out, _ = run_cli(monkeypatch, capsys, ["methods", "--presets", "--json"])
    presets = json.loads(out)
    assert "ada-snapkv" in presets and "evict=snapkv(kernel=7,pooling=max)+adakv budget=1024" in presets["ada-snapkv"]["recipe"]


def test_chat_with_a_recipe_holds_the_budget(monkeypatch, capsys, chat_model_dir):
    words = " ".join(f"word{i}" for i in range(30))  # three turns fit the 512-token context
    stdin = f"{words}\nAgain: {words}\nOnce more: {words}\n/stats\n"
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--recipe", "ada-snapkv",
                                                   "--budget", "24", "--max-new-tokens", "4", "--kv-memory", "32MiB"],
                             stdin)
    assert code == 0, err
    assert "recipe: prefill=dense evict=snapkv(kernel=7,pooling=max)+adakv budget=24" in out
    segments = re.search(r"tokens per head by segment \(system, turn 1, ...\): ([\d ]+)", out)
    per_segment = [int(x) for x in segments.group(1).split()]
    # The finished turns hold the budget, 24 tokens per head on average; the running turn is whole.
    assert len(per_segment) == 4 and abs(sum(per_segment[:3]) - 24) <= 1.5 and per_segment[3] > 40


def test_bad_recipe_is_a_clear_error(monkeypatch, capsys, chat_model_dir):
    code, _, err = run_cli(monkeypatch, capsys, ["generate", "hi", "--model", str(chat_model_dir), "--recipe",
                                                 "evict=snapx", "--kv-memory", "32MiB"])
    assert code == 2 and "unknown scorer 'snapx'" in err and "snapkv" in err


@pytest.mark.parametrize("flags, mode", [([], "turns"), (["--prefix-cache", "system"], "system"),
                                         (["--prefix-cache", "off"], "off"), (["--no-prefix-cache"], "off")])
def test_serve_takes_the_prefix_cache_mode(monkeypatch, capsys, chat_model_dir, flags, mode):
    served = []
    monkeypatch.setattr("turnkv.cli.serve", lambda llm, config, **options: served.append(llm))
    code, _, err = run_cli(monkeypatch, capsys, ["serve", "--model", str(chat_model_dir), "--kv-memory", "8MiB",
                                                 "--no-tiers", *flags])
    assert code == 0, err
    assert served[0].prefix_mode == mode and (served[0].prefix_index is None) == (mode == "off")


def test_serve_names_the_prefix_cache_modes(monkeypatch, capsys, chat_model_dir):
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(chat_model_dir), "--prefix-cache", "all"])
    assert "choose from 'turns', 'system', 'off'" in capsys.readouterr().err


def test_commands_that_keep_an_engine_freeze_the_heap_once_it_is_loaded(monkeypatch, capsys, chat_model_dir):
    """The engine's objects leave the collector's full passes (turnkv.heap) before the first turn."""
    import gc

    from turnkv.engine.llm import LLM

    frozen_at_first_turn = []
    generate = LLM.generate

    def spy(self, *args, **kwargs):
        frozen_at_first_turn.append(gc.get_freeze_count())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    assert gc.get_freeze_count() == 0
    code, _, _ = run_cli(monkeypatch, capsys, ["generate", "Hi", "--model", str(chat_model_dir),
                                               "--max-new-tokens", "2", "--kv-memory", "32MiB"])
    assert code == 0 and frozen_at_first_turn[0] > 10_000
