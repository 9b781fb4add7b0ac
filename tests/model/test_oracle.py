"""Our decoder's logits equal Hugging Face transformers' on the same weights, on every path:
one prefill, token-by-token decode, and a second turn prefilled against kept KV."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import save_tiny
from turnkv.engine.runner import ModelRunner
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.model.load import load_model

FAMILIES = {
    "llama": ("llama", {}),
    "llama3.1-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                 "rope_theta": 500000.0}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def runner_for(model, page_size=4, pages=256):
    c = model.config
    weight = next(model.parameters())
    pool = PagePool(c.num_layers, c.num_kv_heads, c.head_dim, pages, page_size, weight.dtype, weight.device)
    return ModelRunner(model, pool, prefill_chunk=4096), pool


def all_paths(model, ids: torch.Tensor, split: int):
    """Logits for ids [T] three ways: one prefill, prefill + token-by-token decode, two turns."""
    runner, pool = runner_for(model)
    one = runner.prefill(SequenceKV(pool), ids.tolist(), all_logits=True)

    seq = SequenceKV(pool)
    stepwise = [runner.prefill(seq, ids[:1].tolist())]
    for t in ids[1:]:
        stepwise.append(runner.decode([seq], t.view(1).to(pool.device))[0])
    stepwise = torch.stack(stepwise)

    seq = SequenceKV(pool)
    first = runner.prefill(seq, ids[:split].tolist(), all_logits=True)
    second = runner.prefill(seq, ids[split:].tolist(), all_logits=True)
    return one, stepwise, torch.cat([first, second])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_pair(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, family, **overrides)
    ours = load_model(str(path), dtype="float32")
    return request.param, hf, ours.model


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_models_match_transformers_on_every_path(tiny_pair, device):
    name, hf, model = tiny_pair
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.to(device)(ids[None].to(device)).logits[0].cpu()
    for path, logits in zip(("prefill", "decode", "second turn"), all_paths(model.to(device), ids, split=13)):
        logits = logits.cpu()
        assert logits.shape == ref.shape
        assert rel_err(logits, ref) < 1e-4, f"{name}: {path} differs from transformers"


def test_sliding_window_actually_limits_attention(tmp_path):
    """With a window of 8 the logits at position 20 must differ from a windowless model's."""
    save_tiny(tmp_path / "w", "mistral", sliding_window=8)
    save_tiny(tmp_path / "nw", "mistral", sliding_window=None)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(2))
    windowed = all_paths(load_model(str(tmp_path / "w")).model, ids, 10)[0]
    plain = all_paths(load_model(str(tmp_path / "nw")).model, ids, 10)[0]
    assert rel_err(windowed[:8], plain[:8]) < 1e-6
    assert rel_err(windowed[20:], plain[20:]) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(tmp_path, dtype, device):
    hf = save_tiny(tmp_path, "qwen2")
    model = load_model(str(tmp_path), dtype=dtype, device=device).model
    assert next(model.parameters()).dtype == dtype
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for logits in all_paths(model, ids, split=9):
        logits = logits.cpu()
        assert torch.isfinite(logits).all()
        assert rel_err(logits, ref) < 3e-2


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(embedded_model, monkeypatch):
    """SmolLM2-135M from the embedded Q4_1 GGUF: our dequantization and un-permutation of q/k versus
    transformers' own GGUF loader."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    # transformers' loader parses the file twice (config, then weights) and builds gguf's tensor name
    # map once per module of the model: the same read-only results, made once each here.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    path = embedded_model
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model(None, dtype="float32")
    assert loaded.source == "gguf"
    ids = torch.tensor(loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for path_name, logits in zip(("prefill", "decode", "second turn"), all_paths(loaded.model, ids, split=11)):
        assert rel_err(logits, ref) < 1e-4, path_name
