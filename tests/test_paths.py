"""Every path a user gives expands `~` and environment variables, as a shell would: state directories,
model and tokenizer paths, recipe and head-pattern files, data files, benchmark outputs and the
tokenizer cache. Nothing lands in a literal `./~` or `./$VAR` folder."""

from __future__ import annotations

import json
import shutil

import pytest

import turnkv
from turnkv.bench import speed_report
from turnkv.bench.datasets.loaders import load
from turnkv.bench.quality import run_quality
from turnkv.methods.recipe import Recipe
from turnkv.model.tokenizer import cache_dir
from turnkv.paths import user_path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $HOME and $TKV_DATA (its 'data' folder), with the working directory elsewhere, so a
    path that is not expanded shows up as a literal '~' or '$TKV_DATA' folder in the cwd."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TKV_DATA", str(home / "data"))
    monkeypatch.chdir(cwd)
    yield home
    assert not any(cwd.iterdir()), f"a path was taken literally: {sorted(p.name for p in cwd.iterdir())}"


def test_user_path_expands_home_and_variables(home):
    assert user_path("~/x") == home / "x"
    assert user_path("$TKV_DATA/y") == home / "data" / "y"
    assert user_path("${TKV_DATA}/z") == home / "data" / "z"
    assert str(user_path("rel/x")) == "rel/x"


def test_state_disk_dir_model_and_tokenizer_paths(home, chat_model_dir):
    shutil.copytree(chat_model_dir, home / "models" / "tiny")
    (home / "data").mkdir()
    llm = turnkv.LLM("~/models/tiny", device="cpu", kv_memory="8MiB", state_disk_dir="~/.turnkv-state",
                     tokenizer="$HOME/models/tiny")
    assert (home / ".turnkv-state").is_dir() and llm.tokenizer is not None
    conv = llm.conversation()
    conv.send("Hello.", max_new_tokens=2)
    conv.offload("disk")
    assert any((home / ".turnkv-state").glob(f"{conv.id}*"))
    again = turnkv.LLM("$TKV_DATA/../models/tiny", device="cpu", kv_memory="8MiB",
                       state_disk_dir="$HOME/.turnkv-state")
    assert again.resume(conv.id).turns[-1].reply.token_ids == conv.turns[-1].reply.token_ids


def test_recipe_files(home, chat_llm):
    (home / "r.yaml").write_text("preset: snapkv\nbudget: 32\n")
    (home / "data").mkdir()
    (home / "data" / "r.json").write_text(json.dumps({"evict": "h2o", "keep_ratio": 0.5}))
    assert Recipe.from_file("~/r.yaml").evict.budget == 32
    assert chat_llm.conversation(recipe="$TKV_DATA/r.json").recipe.evict.keep_ratio == 0.5


def test_head_pattern_file(home, chat_llm):
    from turnkv.methods.lserve.pattern import HeadPattern

    c = chat_llm.config
    HeadPattern.random(c.num_layers, c.num_kv_heads, 0.5).save_json(home / "pattern.json")
    conv = chat_llm.conversation(recipe="prefill=streaming_heads(pattern=~/pattern.json,sink=4,local=8)")
    conv.send("Hello there.", max_new_tokens=2)
    conv.close()


def test_data_files_and_benchmark_outputs(home):
    record = {"input": "Q?", "context": "C.", "answers": ["A"], "length": 2, "dataset": "hotpotqa",
              "language": "en", "all_classes": None, "_id": "x"}
    (home / "lb.jsonl").write_text(json.dumps(record) + "\n")
    assert load("longbench", "~/lb.jsonl")[0].id == "x"

    result = {"hardware": {"device": "cpu", "copy_bandwidth": 1e10, "matmul_rate": 1e11, "weight_bytes": 1},
              "model": "m", "dtype": "float32", "rows": []}
    speed_report.write(result, "~/speed-out", "turnkv bench speed")
    assert (home / "speed-out" / "speed.json").is_file()
    assert run_quality(None, [], _no_recipes(), "$TKV_DATA/quality/results.jsonl", progress=False) == []
    assert (home / "data" / "quality").is_dir()


def test_tokenizer_cache_variable(home, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE", "~/cache")
    assert cache_dir() == home / "cache"


def _no_recipes():
    from turnkv.bench.quality import QualityConfig

    return QualityConfig(recipes={})
