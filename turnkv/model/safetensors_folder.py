"""Read a Hugging Face model folder: config.json plus one or several safetensors shards."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from turnkv.errors import ModelLoadError
from turnkv.model.config import ModelConfig


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    config = ModelConfig.from_hf(hf)
    generation = folder / "generation_config.json"
    if generation.is_file():
        # generation_config often lists more stop tokens (e.g. Llama 3's <|eot_id|>) than config.json.
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config = replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *extra])))
    return config


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{folder} has no *.safetensors files")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks the shard {missing[0]} named in its index")
        shards = [folder / n for n in sorted(names)]
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            tensors.update(load_file(str(shard)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {shard}: {e}") from None
    return tensors
