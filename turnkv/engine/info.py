"""What a model needs, read from its shape alone: no weights are built or read.

`model_info` backs `turnkv info`. It reads a named shape's config, a Hugging Face folder's
config.json or a GGUF file's header (the tensors stay on disk), and returns the parameter count,
the weight and KV bytes, and the largest context whose weights + KV fit a given memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from turnkv.errors import DeviceError
from turnkv.kv.pool import PagePool
from turnkv.kv.quant import kv_dtype_name
from turnkv.model import gguf_file, safetensors_folder
from turnkv.model.config import ModelConfig, shape_config
from turnkv.model.load import locate_model, resolve_dtype


def read_config(model: str | Path | None) -> tuple[str, str, ModelConfig]:
    """(name, source, config) of `model` as `load_model` takes it: None or the embedded default, a
    GGUF file, a Hugging Face folder, or a shape name. Source: "gguf", "safetensors" or "random"."""
    name, path = locate_model(model)
    if path is None:
        return name, "random", shape_config(name)
    if path.is_dir():
        return name, "safetensors", safetensors_folder.read_config(path)
    return name, "gguf", gguf_file.read_config(gguf_file.open_reader(path))


def model_info(model: str | Path | None = None, dtype: str | None = None, device: str | None = None,
               kv_dtype: str | None = None, memory: int = 80 << 30, kv_memory: int | None = None,
               page_size: int = 16) -> dict:
    """Shape, parameters, weight bytes, KV bytes per token and the largest context that fits.

    memory: bytes for weights + KV (80 GiB, one H100, by default). kv_tokens_in_memory: the tokens
    whose KV fits beside the weights (over all conversations), in whole pages of `page_size`;
    largest_context: the same capped at the model's positions (0 when the weights alone do not fit).
    Activations and workspace are not counted. kv_memory: a KV pool size, whose
    capacity in tokens is reported as kv_pool_tokens."""
    name, source, c = read_config(model)
    # The device only picks the default dtype: a GPU's footprint can be planned on a machine without one.
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    dtype = resolve_dtype(dtype, device)
    kv_name = kv_dtype_name(kv_dtype)
    # As the engine's pool stores K/V: rows in the compute dtype, or one-byte codes + fp32 scales.
    per_token = c.num_layers * c.num_kv_heads * PagePool.token_head_bytes(c.head_dim, dtype, kv_name)
    weights = c.num_parameters() * dtype.itemsize
    fits = max(0, memory - weights) // per_token // page_size * page_size
    info = {
        "model": name, "source": source, "architecture": c.architecture, "parameters": c.num_parameters(),
        "layers": c.num_layers, "hidden_size": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "dtype": str(dtype).removeprefix("torch."), "weight_bytes": weights, "kv_dtype": kv_name, "kv_bytes_per_token": per_token,
        "memory_bytes": memory, "kv_tokens_in_memory": fits, "largest_context": min(fits, c.max_position_embeddings),
    }
    if kv_memory is not None:
        info["kv_pool_tokens"] = kv_memory // per_token // page_size * page_size
    return info
