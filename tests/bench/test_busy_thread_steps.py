"""The busy-thread step benchmark runs end to end on a tiny random model on CPU."""

import dataclasses
import importlib.util
import pathlib


from turnkv.model import config as model_config

PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "serving" / "busy_thread_steps.py"


def test_each_recipe_times_its_cycles_alone_and_beside_a_busy_thread(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("busy_thread_steps", PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = dataclasses.replace(model_config.SHAPES["llama-3.1-8b"], vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    monkeypatch.setitem(model_config.SHAPES, "tiny-busy", tiny)
    out = bench.main(["--model", "tiny-busy", "--dtype", "float32", "--device", "cpu", "--kv-memory", "64MiB",
                      "--recipes", "full,lserve-random decode=lserve(budget=64) "
                      "prefill=streaming_heads(pattern=random,sink=16,local=32,prefill_local=64)",
                      "--n", "3", "--context", "256", "--new", "8", "--cycles", "1", "--warmup", "1", "--busy", "0.5",
                      "--out", str(tmp_path / "o.json")])
    assert list(out["recipes"]) == ["full", "lserve-random decode=lserve(budget=64) "
                                    "prefill=streaming_heads(pattern=random,sink=16,local=32,prefill_local=64)"]
    for rows in out["recipes"].values():
        for label in ("alone", "busy"):
            (cycle,) = rows[label]
            assert cycle["forward"] > 0 and len(cycle["decodes"]) == 3 and all(d > 0 for d in cycle["decodes"])
    assert (tmp_path / "o.json").exists()
