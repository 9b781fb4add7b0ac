"""Read a GGUF file of a llama/qwen2 model: the config from its metadata, the weights dequantized to
Hugging Face names and layout."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from turnkv.errors import ModelLoadError
from turnkv.model.config import ModelConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def open_reader(path: Path):
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, KeyError or struct errors on damage
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key}")
        return default
    return field.contents()


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; turnkv reads {', '.join(_ARCHITECTURES)}")
    hidden = _field(reader, f"{arch}.embedding_length")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", -1)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 4096),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        architecture=_ARCHITECTURES[arch],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", -1),
        eos_token_ids=() if eos < 0 else (eos,),
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rope pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensors(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    permuted = _field(reader, "general.architecture") == "llama"
    tensors = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.{i}.{kind}.{weight|bias}
            if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                continue  # e.g. rope_freqs, which we compute from the config
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _unpermute(array, config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _unpermute(array, config.num_kv_heads)
        tensors[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
    return tensors


def chat_template(reader) -> str | None:
    field = reader.fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None
