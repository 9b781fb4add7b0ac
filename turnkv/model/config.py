"""Model configuration for the Llama family, read from Hugging Face config.json or a named shape."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from turnkv.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "smollm2")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder.

    Covers Llama 2/3/3.1/3.2 (llama3 rope scaling), Mistral (optional sliding window),
    Qwen2/2.5 (bias on q/k/v) and SmolLM2, which is a plain llama.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V that one token occupies across all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * layer + v * h + head + h

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; turnkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
            rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            eos = hf.get("eos_token_id")
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
                rope_theta=float(theta),
                rope_scaling=None if rope_type == "default" else rope,
                attention_bias=hf.get("attention_bias", model_type == "qwen2"),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                sliding_window=hf.get("sliding_window") if _uses_sliding_window(hf, model_type) else None,
                architecture=model_type,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from None


def _uses_sliding_window(hf: dict, model_type: str) -> bool:
    if model_type == "qwen2":
        return bool(hf.get("use_sliding_window", False))
    return model_type == "mistral"


def _llama3_rope(factor: float, original: int = 8192) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


# Real model shapes, for speed benchmarks with random weights on hardware without the checkpoints.
SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    "smollm2-360m": ModelConfig(
        vocab_size=49152, hidden_size=960, intermediate_size=2560, num_layers=32, num_heads=15,
        num_kv_heads=5, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    "llama-2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_ids=(2,),
    ),
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
        eos_token_ids=(128001, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0), eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0), eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-3b": ModelConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True, eos_token_ids=(128001, 128008, 128009),
    ),
    "mistral-7b": ModelConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
        architecture="mistral", eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        attention_bias=True, tie_word_embeddings=True, architecture="qwen2", eos_token_ids=(151645, 151643),
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        attention_bias=True, architecture="qwen2", eos_token_ids=(151645, 151643),
    ),
}


def shape_config(name: str, max_position_embeddings: int | None = None) -> ModelConfig:
    """The config of a named real shape; raises ModelLoadError listing the known names."""
    key = name.lower()
    if key not in SHAPES:
        raise ModelLoadError(f"unknown model shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}")
    config = SHAPES[key]
    if max_position_embeddings:
        config = replace(config, max_position_embeddings=max_position_embeddings)
    return config


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-channel-pair inverse frequencies, with linear or llama3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
