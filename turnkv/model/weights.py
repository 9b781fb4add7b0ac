"""Map Hugging Face parameter names onto the decoder, fusing q/k/v and gate/up."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from turnkv.errors import ModelLoadError
from turnkv.model.decoder import Transformer

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_DIRECT = {
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
_FUSED = {  # our fused parameter -> the HF parameters it concatenates, in order
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def load_hf_weights(model: Transformer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into `model`. Every parameter must be covered, with the right shape."""
    ours = dict(model.named_parameters())
    loaded: set[str] = set()

    def put(name: str, value: torch.Tensor):
        target = ours[name]
        if tuple(target.shape) != tuple(value.shape):
            raise ModelLoadError(f"weight {name}: expected shape {tuple(target.shape)}, file has {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)
        loaded.add(name)

    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in tensors:
            raise ModelLoadError(f"the checkpoint lacks {name}")
        put(name.removeprefix("model."), tensors[name])
    if not model.config.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise ModelLoadError("the checkpoint lacks lm_head.weight and its config does not tie embeddings")
        put("lm_head.weight", tensors["lm_head.weight"])

    for i in range(model.config.num_layers):
        prefix = f"model.layers.{i}."
        for hf_name, our_name in _DIRECT.items():
            if prefix + hf_name not in tensors:
                raise ModelLoadError(f"the checkpoint lacks {prefix + hf_name}")
            put(f"layers.{i}.{our_name}", tensors[prefix + hf_name])
        for our_name, parts in _FUSED.items():
            if f"layers.{i}.{our_name}" not in ours:
                continue
            missing = [p for p in parts if prefix + p not in tensors]
            if missing:
                raise ModelLoadError(f"the checkpoint lacks {prefix + missing[0]}")
            put(f"layers.{i}.{our_name}", torch.cat([tensors[prefix + p] for p in parts], dim=0))

    unfilled = set(ours) - loaded
    if model.config.tie_word_embeddings:
        unfilled.discard("lm_head.weight")
    if unfilled:
        raise ModelLoadError(f"weights not found in the checkpoint: {sorted(unfilled)[:5]}")


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names. Fused q/k/v and gate/up come back as row slices
    of the fused tensors: views, so a transformers model built from them shares turnkv's memory."""
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    c = model.config
    sizes = {"self_attn.qkv_proj": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
             "mlp.gate_up_proj": [c.intermediate_size, c.intermediate_size]}
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        params = dict(block.named_parameters())
        for hf_name, our_name in _DIRECT.items():
            out[prefix + hf_name] = params[our_name]
        for our_name, parts in _FUSED.items():
            if our_name not in params:
                continue
            fused = params[our_name].split(sizes[our_name.rsplit(".", 1)[0]], dim=0)
            for hf_name, piece in zip(parts, fused):
                out[prefix + hf_name] = piece
    return out
