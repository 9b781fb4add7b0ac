"""Read a GGUF file of a llama/qwen2 model: the config from its metadata, the weights dequantized to
Hugging Face names and layout.

The header is parsed here with struct over a memory map rather than by gguf.GGUFReader, which builds
numpy views of every element of the tokenizer's arrays (about 100K strings: seconds per open); the
tensors stay in the map until read_tensors dequantizes them with gguf.quants.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
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

# GGUF metadata value types (gguf.GGUFValueType): struct formats of the scalars, then string and array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numpy elements; every other type is blocks of bytes that gguf.quants decodes.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file: elements of a plain type, else the blocks' bytes per row


class GGUFFile:
    """A little-endian GGUF file (versions 2 and 3): `metadata` maps each key to its value (numbers,
    strings, lists), `tensors` lists the tensors in file order. Raises ValueError, struct.error or
    UnicodeDecodeError on a damaged or truncated file."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._map[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self._offset = 4
        version = self._scalar("I")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file; turnkv reads little-endian ones")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key}")
            self.metadata[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._scalar("Q")
        end = self._offset + size
        if end > len(self._map):
            raise ValueError("a string runs past the end of the file")
        text = self._map[self._offset:end].decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self._scalar("I"), self._scalar("Q")
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self._map, dtype, count, self._offset).tolist()
            self._offset += dtype.itemsize * count
            return values
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple:
        name = self._string()
        dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
        return name, dims, gguf.GGMLQuantizationType(self._scalar("I")), self._scalar("Q")

    def _tensor(self, start: int, name: str, dims: list[int], kind, offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        if kind.name in _PLAIN:
            dtype, count = np.dtype(_PLAIN[kind.name]), int(np.prod(shape))
        else:
            shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
            dtype, count = np.dtype(np.uint8), int(np.prod(shape))
        data = np.frombuffer(self._map, dtype, count, start + offset)  # ValueError past the end
        return GGUFTensor(name, kind, data.reshape(shape))


def open_reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return GGUFFile(path)
    except Exception as e:  # ValueError, struct.error or UnicodeDecodeError on damage
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.metadata.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key}")
        return default
    return value


def read_config(reader: GGUFFile) -> ModelConfig:
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


def _dequantize(t: GGUFTensor, chunk: int = 1 << 20) -> np.ndarray:
    """gguf.quants.dequantize of `t`, fed about `chunk` values per call as one long row: blocks decode
    independently, so the values are the same, while gguf's own split into groups of 16 rows costs
    seconds of Python overhead per model on narrow rows."""
    if t.tensor_type.name in _PLAIN:
        return gguf.quants.dequantize(t.data, t.tensor_type)
    rows = t.data.reshape(-1, t.data.shape[-1])
    shape = gguf.quants.quant_shape_from_byte_shape(t.data.shape, t.tensor_type)
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, chunk // shape[-1])
    for i in range(0, rows.shape[0], step):
        part = rows[i:i + step]
        out[i:i + step] = gguf.quants.dequantize(part.reshape(1, -1), t.tensor_type).reshape(len(part), -1)
    return out.reshape(shape)


def read_tensors(reader: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
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
            array = _dequantize(t)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _unpermute(array, config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _unpermute(array, config.num_kv_heads)
        tensors[hf_name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # copies a view of the map
    return tensors


def chat_template(reader: GGUFFile) -> str | None:
    return reader.metadata.get("tokenizer.chat_template")
