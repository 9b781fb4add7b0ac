"""A compact Llama-family decoder whose attention runs over turnkv's paged KV store.

The module tree mirrors gpt-fast: Transformer -> Block -> (Attention, FeedForward, RMSNorm).
q/k/v and gate/up projections are fused into one matmul each. Attention itself is delegated to the
step object the engine passes in, which owns the KV store and the attention path.

The residual stream is carried beside each block's output rather than added to it at the block's end:
the add happens inside the next norm (ops.add_rms_norm), one fused kernel on CUDA. The ops in between
(projections, RoPE, SiLU * up) go through turnkv/model/ops.py, which picks Triton kernels on CUDA and
the plain torch ops elsewhere.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from turnkv.model import ops
from turnkv.model.config import ModelConfig, rope_inverse_frequencies


class AttentionStep(Protocol):
    """What a layer needs from the engine: store this step's K/V and attend over the kept state.

    A step may also define `rotate(layer, qkv, num_heads, cos, sin)`, which the layer then calls in
    place of ops.rotate_heads (same contract: returns heads [0, num_heads) of qkv rotated), so that
    the rotation can share a kernel with the step's own stores (the graphed decode step's)."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] (post-RoPE) -> [B, T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """rmsnorm(x); given the residual stream, first residual += x (in place) and norm the sum."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose decode-sized calls take the skinny matmul on CUDA (ops.linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_dim + 2 * kv_dim, bias=config.attention_bias)
        self.o_proj = Linear(q_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, step: AttentionStep):
        B, T, _ = x.shape
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, Hq + 2 * Hkv, self.head_dim)
        # One rotation over q and k together: half the launches of two.
        rotate = getattr(step, "rotate", None)
        if rotate is not None:
            q, k = rotate(self.layer, qkv, Hq + Hkv, cos, sin).split([Hq, Hkv], dim=2)
        else:
            q, k = ops.rotate_heads(qkv, Hq + Hkv, cos, sin).split([Hq, Hkv], dim=2)
        out = step.attention(self.layer, q, k, qkv[:, :, Hq + Hkv :])
        return self.o_proj(out.reshape(B, T, Hq * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        # Written over the gate half: no new [T, I] buffer.
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x), self.intermediate_size))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x, residual, cos, sin, step):
        """x: the previous block's output, not yet added to the residual stream `residual`; the first
        block gets the embeddings and None. Returns (this block's output, the residual stream before
        it): the caller adds them, in the next norm. `residual` is updated in place."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, step), residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # fp64 so that angles stay exact at long positions; cos/sin are cast to the model dtype.
        self.register_buffer("inv_freq", rope_inverse_frequencies(config).double(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        angles = positions.double()[..., None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: AttentionStep,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [B, T]. Returns logits at `logits_at` ([B, K] indices into T), or at
        every position when it is None."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        residual = None
        for block in self.layers:
            x, residual = block(x, residual, cos, sin, step)
        if logits_at is not None:
            index = logits_at[..., None].expand(-1, -1, x.shape[-1])
            x = x.gather(1, index)
            residual = None if residual is None else residual.gather(1, index)
        return self.lm_head(self.norm(x, residual)).float()
