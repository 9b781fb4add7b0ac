"""DuoAttention-style gate optimisation: which KV heads can stream without changing the model.

Each KV head's attention output becomes `a * full + (1 - a) * streaming` with a trainable gate `a`
(start 1.0, clamped to [0, 1]); the model is frozen. The loss is the MSE between the final (post
norm) hidden states of the answer tokens under full attention and under the gated mix, plus
`reg_weight * mean|a|`. The L1 term pulls every gate to 0 (streaming); only heads whose streaming
output changes the answer push back, so the gates separate retrieval from streaming heads.

The L1 term is a mean over heads (not a sum), so `reg_weight` does not depend on the model's head
count; Adam's step size makes only the balance with the distillation gradient matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from turnkv.methods.lserve.calibrate_stats import unwrap_model
from turnkv.methods.lserve.masks import streaming_mask
from turnkv.methods.lserve.passkey import PasskeySample, passkey_samples
from turnkv.methods.lserve.pattern import HeadPattern


class GatedStep:
    """AttentionStep over fresh sequences: per KV head, gate * full causal + (1 - gate) * streaming.
    With gates=None it is plain full attention (the distillation target)."""

    def __init__(self, gates: torch.Tensor | None, sink: int, local: int):
        self.gates, self.sink, self.local = gates, sink, local

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.gates is None:
            return full.transpose(1, 2)
        mask = streaming_mask(q.shape[2], self.sink, self.local, q.device)
        stream = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        gate = self.gates[layer].repeat_interleave(q.shape[1] // k.shape[1]).to(q.dtype)[None, :, None, None]
        return (stream + gate * (full - stream)).transpose(1, 2)


@dataclass
class GateResult:
    gates: np.ndarray  # [layers, kv_heads] in [0, 1]
    history: list[dict] = field(default_factory=list)  # per step: distill, reg, loss, lr
    meta: dict = field(default_factory=dict)

    def pattern(self, sparsity: float = 0.5) -> HeadPattern:
        return HeadPattern.from_gates(self.gates, sparsity, meta={"source": "gate-optimisation", **self.meta})


def final_hidden(model, tokens: torch.Tensor, at: torch.Tensor, step) -> torch.Tensor:
    """Post-norm final hidden states [1, len(at), hidden] at token indices `at`.

    The same computation as Transformer.forward up to its final norm, written without the in-place
    ops the inference model uses for speed (autograd cannot go through in-place ops on split
    views). A test checks it against the model's own forward, so the two cannot drift apart."""
    x = model.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    cos, sin = model.rope(positions, x.dtype)
    B, T, _ = x.shape
    for block in model.layers:
        attn = block.self_attn
        Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(block.input_layernorm(x)).view(B, T, Hq + 2 * Hkv, D)
        qk = qkv[:, :, : Hq + Hkv]
        rotated = torch.cat((-qk[..., D // 2:], qk[..., : D // 2]), dim=-1)
        q, k = (qk * cos + rotated * sin).split([Hq, Hkv], dim=2)
        out = step.attention(attn.layer, q, k, qkv[:, :, Hq + Hkv:])
        x = x + attn.o_proj(out.reshape(B, T, Hq * D))
        mlp = block.mlp
        gate, up = mlp.gate_up_proj(block.post_attention_layernorm(x)).split(mlp.intermediate_size, dim=-1)
        x = x + mlp.down_proj(F.silu(gate) * up)
    return model.norm(x[:, at])


def _lr_factor(step: int, steps: int) -> float:
    """Warm-up and cool-down over 1/5 of the steps each, floor 0.1 (DuoAttention's schedule)."""
    edge = max(steps // 5, 1)
    if step < edge:
        return 0.1 + 0.9 * step / edge
    if step >= steps - edge:
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - (steps - edge)) / edge))
    return 1.0


def optimize_gates(llm, steps: int = 100, samples: list[PasskeySample] | None = None, sink: int = 128,
                   local: int = 256, reg_weight: float = 0.05, lr: float = 0.02, num_samples: int = 8,
                   num_tokens: int = 1024, num_keys: int = 4, seed: int = 0, log=None) -> GateResult:
    """Train one gate per (layer, KV head) on synthetic multi-passkey text; the model stays frozen.

    `llm` is a turnkv.LLM (its tokenizer makes real text) or a Transformer (random-id passkeys).
    Contexts must be longer than sink + local, or streaming equals full and nothing is learnt."""
    model = unwrap_model(llm)
    config = model.config
    device = next(model.parameters()).device
    if samples is None:
        tokenizer = getattr(llm, "tokenizer", None)
        samples = passkey_samples(tokenizer, num_samples, num_tokens, num_keys,
                                  vocab_size=config.vocab_size, seed=seed)
    if max(len(s.tokens) for s in samples) <= sink + local:
        raise ValueError(f"calibration samples ({max(len(s.tokens) for s in samples)} tokens) must be longer "
                         f"than sink + local ({sink} + {local}) for the gates to learn anything")
    data = [(torch.tensor(s.tokens, device=device)[None], torch.tensor(s.answer, device=device)) for s in samples]
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    gates = torch.ones(config.num_layers, config.num_kv_heads, device=device, dtype=torch.float32, requires_grad=True)
    optimiser = torch.optim.AdamW([gates], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: _lr_factor(s, steps))
    with torch.no_grad():  # the frozen model's full-attention answer states, once per sample
        targets = [final_hidden(model, tokens, at, GatedStep(None, sink, local)) for tokens, at in data]
    history = []
    try:
        for step in range(steps):
            index = step % len(data)
            tokens, at = data[index]
            mixed = final_hidden(model, tokens, at, GatedStep(gates, sink, local))
            distill = (mixed.float() - targets[index].float()).pow(2).mean()
            reg = gates.abs().mean()
            loss = distill + reg_weight * reg
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
            row = {"step": step, "distill": distill.item(), "reg": reg.item(), "loss": loss.item(),
                   "lr": optimiser.param_groups[0]["lr"]}
            history.append(row)
            if log is not None:
                log(row)
    finally:
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
    meta = {"sink": sink, "local": local, "reg_weight": reg_weight, "lr": lr, "steps": steps,
            "samples": len(samples), "tokens": max(len(s.tokens) for s in samples)}
    return GateResult(gates.detach().cpu().numpy().astype(np.float64), history, meta)
