"""The sync-points script: sites named by their turnkv frames, counted per part; end to end on CPU."""

import dataclasses
import importlib.util
import pathlib
import sys
import traceback

import torch

from turnkv.model import config as model_config

PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "serving" / "sync_points.py"


def _load():
    spec = importlib.util.spec_from_file_location("sync_points", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_site_is_named_by_its_innermost_turnkv_frames():
    bench = _load()
    frames = [traceback.FrameSummary("/x/site-packages/torch/a.py", 1, "f"),
              traceback.FrameSummary("/r/turnkv/engine/step.py", 10, "attention"),
              traceback.FrameSummary("/r/turnkv/kv/pool.py", 20, "write"),
              traceback.FrameSummary("/x/site-packages/torch/b.py", 2, "g")]
    assert bench.site(frames, 2) == "kv/pool.py:20 write < engine/step.py:10 attention"
    assert bench.site(frames[:1], 2) == "?"
    sites = bench.SyncSites(torch.device("cpu"), depth=1)
    sites.record("forward", "called a synchronizing CUDA operation", frames)
    sites.record("forward", "some other warning", frames)
    assert dict(sites.counts["forward"]) == {"kv/pool.py:20 write": 1}


def test_it_runs_each_recipes_cycles_on_cpu(monkeypatch, tmp_path):
    bench = _load()
    tiny = dataclasses.replace(model_config.SHAPES["llama-3.1-8b"], vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    monkeypatch.setitem(model_config.SHAPES, "tiny-sync", tiny)
    out = bench.main(["--model", "tiny-sync", "--dtype", "float32", "--device", "cpu", "--kv-memory", "64MiB",
                      "--recipes", "full", "--n", "2", "--context", "128", "--new", "8", "--cycles", "1",
                      "--out", str(tmp_path / "o.json")])
    assert out["recipes"] == {"full": {}}  # a CPU never synchronizes
    assert (tmp_path / "o.json").exists()
    sys.modules.pop("busy_thread_steps", None)
