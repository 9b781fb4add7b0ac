"""benchmarks/parallel/check_gpu.py: its arguments, and a tiny run of both parts on CPU (N=2 over gloo,
the tiny random chat model): the same tokens and kept sets as N=1, and the timings written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.parallel.conftest import TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "parallel"))

import check_gpu  # noqa: E402


def test_arguments():
    args = check_gpu.parse_args([])
    assert (args.model, args.device, args.dtype, args.tensor_parallel, args.prompt_tokens) == (
        "llama-3.1-8b", "cuda", "float32", 2, 4096)
    args = check_gpu.parse_args(["--prompt-tokens", "1024", "--recipes", "full,quest", "--tensor-parallel", "4",
                                 "--skip-timing", "--out", "x.json"])
    assert (args.prompt_tokens, args.recipes, args.tensor_parallel, args.skip_timing, args.out) == (
        1024, "full,quest", 4, True, "x.json")
    for bad in (["--tensor-parallel", "1"], ["--prompt-tokens", "0"]):
        with pytest.raises(SystemExit):
            check_gpu.parse_args(bad)


def test_gpu_count_is_checked_first(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert check_gpu.main(["--out", "/nonexistent/x.json"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err


def test_tiny_cpu_run(chat_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TURNKV_TP_TIMEOUT", TIMEOUT_S)
    out = tmp_path / "check.json"
    code = check_gpu.main(["--model", str(chat_model_dir), "--device", "cpu", "--kv-memory", "16MiB",
                           "--prompt-tokens", "48", "--new-tokens", "4", "--steps", "6", "--all-reduce-iterations", "5",
                           "--recipes", "full,ada-snapkv keep_ratio=0.5,snapkv keep_ratio=0.5 state=krul",
                           "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [r["recipe"] for r in result["tokens"]] == ["full", "ada-snapkv keep_ratio=0.5",
                                                      "snapkv keep_ratio=0.5 state=krul"]
    assert all(r["same_tokens"] and r["same_kept"] and len(r["tokens_n"]) == 3 for r in result["tokens"])
    assert result["tokens"][0]["history_tokens"] > 48
    timing = result["timing"]
    assert timing["tpot_graphs_s"] is None and timing["tpot_eager_s"] > 0  # no CUDA graphs on CPU
    assert len(timing["all_reduce"]) == 2 and all(r["eager_s"] > 0 and "graph_s" not in r for r in timing["all_reduce"])
    assert timing["all_reduces_per_step"] == 2 * 2 + 1
    assert "| ada-snapkv keep_ratio=0.5 | yes | yes |" in printed and "one all-reduce" in printed


def test_kept_difference_names_the_heads_and_positions_that_differ():
    from turnkv.bench.parallel_check import kept_difference, table

    one = {(0, 0): (0, 1, 2), (0, 1): (0, 3), (1, 0): (5,)}
    assert kept_difference(one, dict(one)) is None
    many = {(0, 0): (0, 1, 2), (0, 1): (0, 4), (1, 0): (5,)}
    diff = kept_difference(one, many)
    assert diff == {"heads": 1, "of_heads": 3, "positions_on_one_side": 2,
                    "first": {"layer": 0, "kv_head": 1, "only_n1": [3], "only_n": [4]}}
    row = {"recipe": "snapkv", "same_tokens": True, "same_kept": False, "first_difference": None,
           "kept_difference": diff}
    assert "NO: 1 of 3 heads, 2 positions" in table([row])
