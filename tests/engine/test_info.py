"""`turnkv info` reads a model's shape without building its weights: parameters, KV bytes per token
and the largest context that fits a memory, fast enough for a 70B shape on a small CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="turnkv.cli imports the server (the serve extra)")

from turnkv.cli import main  # noqa: E402
from turnkv.engine.info import model_info  # noqa: E402
from turnkv.model.config import shape_config  # noqa: E402

GIB = 1 << 30


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the child's peak memory from /proc (Linux)")
def test_a_70b_shape_answers_without_building_the_engine():
    # A fresh interpreter, as the command runs; transformers (tokenizers) is not even imported.
    code = ("import json, sys\nfrom turnkv.cli import main\n"
            "assert main(['info', '--model', 'llama-3.1-70b', '--dtype', 'bfloat16', '--json']) == 0\n"
            "heavy = [m for m in ('transformers',) if m in sys.modules]\n"
            "print(json.dumps(heavy))\n")
    # The child's peak resident memory in KiB: VmHWM belongs to its own address space, where
    # ru_maxrss would also count the forked test process it was exec'd from.
    peak = "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0])\n"
    # Nothing of the model is built: the child's peak memory stays that of the imports (about 0.25 GiB
    # on CPU torch, more with CUDA libraries), not the 141 GB of 70B weights. How long the command
    # takes is a benchmark's question, not this test's.
    run = subprocess.run([sys.executable, "-c", code + peak], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    info_text, heavy, peak_kib = run.stdout.rsplit("\n", 3)[:3]
    assert json.loads(heavy) == []
    assert json.loads(info_text)["parameters"] == 70_553_706_496  # Llama-3.1-70B's published count
    assert int(peak_kib) < 4 * GIB // 1024, f"turnkv info peaked at {int(peak_kib) / 2**20:.1f} GiB"


def test_figures_follow_from_the_shape(monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("turnkv info built a model")

    monkeypatch.setattr("turnkv.model.load.empty_model", no_weights)
    c = shape_config("llama-3.1-70b")
    info = model_info("llama-3.1-70b", dtype="bfloat16", device="cpu", memory=160 * GIB)
    per_token = c.num_layers * c.num_kv_heads * 2 * c.head_dim * 2  # K and V, bf16
    assert info["kv_bytes_per_token"] == per_token == 327_680
    assert info["weight_bytes"] == 2 * info["parameters"]
    fits = (160 * GIB - info["weight_bytes"]) // per_token // 16 * 16
    assert info["kv_tokens_in_memory"] == fits and info["largest_context"] == min(fits, 131_072)
    assert 90_000 < fits < 100_000
    # One-byte codes plus an fp32 scale per row of K and of V.
    int8 = model_info("llama-3.1-70b", dtype="bfloat16", device="cpu", kv_dtype="int8", memory=160 * GIB)
    assert int8["kv_bytes_per_token"] == c.num_layers * c.num_kv_heads * 2 * (c.head_dim + 4)
    # Weights that alone exceed the memory leave no context; a roomy memory is capped at the positions.
    assert model_info("llama-3.1-70b", dtype="float32", device="cpu", memory=80 * GIB)["largest_context"] == 0
    assert model_info("llama-3.1-8b", dtype="bfloat16", device="cpu", memory=1 << 40)["largest_context"] == 131_072


def test_the_command_prints_the_same_figures(monkeypatch, capsys):
    assert main(["info", "--model", "llama-3.1-8b", "--dtype", "bf16", "--memory", "24GiB", "--kv-memory", "1GiB",
                 "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == 8_030_261_248 and info["kv_bytes_per_token"] == 131_072
    assert info["largest_context"] == (24 * GIB - 2 * 8_030_261_248) // 131_072 // 16 * 16
    assert info["kv_pool_tokens"] == 8192
    assert main(["info", "--model", "llama-3.1-8b", "--memory", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


@pytest.mark.slow
def test_a_gguf_file_is_read_from_its_header(monkeypatch, embedded_model):
    monkeypatch.setattr("turnkv.model.gguf_file.read_tensors", lambda *a: pytest.fail("read the tensors"))
    info = model_info(None, dtype="float32", device="cpu")
    assert info["source"] == "gguf" and info["parameters"] == shape_config("smollm2-135m").num_parameters()
    assert info["kv_bytes_per_token"] == 30 * 3 * 2 * 64 * 4
