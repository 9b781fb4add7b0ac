"""Weight loading: sharded safetensors, named random shapes, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import save_tiny
from turnkv.errors import ModelLoadError
from turnkv.model.config import SHAPES, shape_config
from turnkv.model.load import load_model


def test_sharded_safetensors_folder_loads_like_a_single_file(tmp_path):
    hf = save_tiny(tmp_path / "one", "llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    one = load_model(str(tmp_path / "one")).model.state_dict()
    sharded = load_model(str(tmp_path / "sharded")).model.state_dict()
    assert one.keys() == sharded.keys()
    assert all(torch.equal(one[k], sharded[k]) for k in one)


def test_tied_embeddings_share_one_tensor(tmp_path):
    save_tiny(tmp_path, "llama", tie_word_embeddings=True)
    model = load_model(str(tmp_path)).model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name,params", [("llama-3.1-8b", 8_030_261_248), ("llama-3.2-1b", 1_235_814_400),
                                         ("qwen2.5-7b", 7_615_616_512), ("smollm2-135m", 134_515_008)])
def test_named_shapes_have_the_real_parameter_counts(name, params):
    assert shape_config(name).num_parameters() == params


def test_random_shape_builds_and_runs():
    loaded = load_model("smollm2-135m", dtype="bfloat16", seed=3)
    assert loaded.source == "random"
    p = dict(loaded.model.named_parameters())
    assert p["layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    assert 0.015 < p["layers.0.mlp.down_proj.weight"].float().std().item() < 0.025
    assert torch.equal(p["norm.weight"], torch.ones(576, dtype=torch.bfloat16))
    again = load_model("smollm2-135m", dtype="bfloat16", seed=3).model
    assert torch.equal(again.layers[5].mlp.down_proj.weight, loaded.model.layers[5].mlp.down_proj.weight)


def test_unknown_shape_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match="llama-3.1-8b"):
        load_model("llama-9-7b")


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\xff" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad))


def test_truncated_gguf_is_a_clear_error(tmp_path, embedded_model):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(embedded_model.read_bytes()[: 4 << 20])
    with pytest.raises(ModelLoadError):
        load_model(str(truncated))


def test_corrupt_or_incomplete_safetensors(tmp_path):
    save_tiny(tmp_path, "llama")
    shard = tmp_path / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(str(tmp_path))


def test_missing_weight_and_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(str(tmp_path))
    save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight|norm.weight"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    save_tiny(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(str(tmp_path))


def test_every_shape_is_consistent():
    for name, config in SHAPES.items():
        assert config.num_heads % config.num_kv_heads == 0, name
        assert config.kv_bytes_per_token(2) == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2


@pytest.mark.parametrize("user_setting", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_are_asked_for_unless_the_user_configured_the_allocator(user_setting, monkeypatch):
    from turnkv.model import load

    asked = []
    monkeypatch.setattr(load, "set_allocator_settings", asked.append)
    for name in load.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    if user_setting is not None:
        monkeypatch.setenv(user_setting, "max_split_size_mb:512")
    assert load.use_expandable_segments() == (user_setting is None)
    assert asked == ([] if user_setting else ["expandable_segments:True"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_on_a_gpu_allocates_in_expandable_segments(tmp_path, monkeypatch):
    import turnkv
    from turnkv.model import load

    for name in load.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    save_tiny(tmp_path, "llama")
    turnkv.LLM(str(tmp_path), device="cuda", kv_memory="64MiB")
    fresh = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a new segment, after the setting
    segments = torch.cuda.memory._snapshot()["segments"]
    assert any(s.get("is_expandable") and s["address"] <= fresh.data_ptr() < s["address"] + s["total_size"]
               for s in segments)
