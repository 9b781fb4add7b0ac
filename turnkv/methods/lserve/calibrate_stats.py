"""Head patterns from attention statistics: per (layer, KV head), the attention mass that falls
outside the sink and local window on calibration text. A head that needs that mass cannot stream.

The model runs dense causal attention through `StatsStep` (its own AttentionStep, no KV pool), which
measures the mass on the way. Cheaper than gate training (forward only) and model-agnostic.
"""

from __future__ import annotations

import torch

from turnkv.attention import reference
from turnkv.methods.lserve.masks import outside_mask
from turnkv.methods.lserve.pattern import HeadPattern


def unwrap_model(llm_or_model):
    """A turnkv.LLM or its Transformer -> the Transformer."""
    return getattr(llm_or_model, "model", llm_or_model)


class StatsStep:
    """Dense causal attention over fresh sequences that also sums, per (layer, kv_head), the mass
    each query puts outside [0, sink) ∪ (i - local, i]. Only queries that have keys outside the
    window (i >= sink + local) count, so short prefixes do not dilute the mean."""

    def __init__(self, num_layers: int, num_kv_heads: int, sink: int, local: int):
        self.sink, self.local = sink, local
        self.mass = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, Hq, D = q.shape
        H = k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
        weights = reference.attention_weights(q, k, causal)  # [B, Hq, T, T] fp32
        outside = outside_mask(T, self.sink, self.local, q.device)
        rows = outside.any(dim=1)  # queries with something outside the window
        if rows.any():
            per_query = (weights * outside).sum(-1)[:, :, rows]  # [B, Hq, R]
            per_kv = per_query.view(B, H, Hq // H, -1)
            self.mass[layer] += per_kv.sum(dim=(0, 2, 3)).double().cpu()
            self.count[layer] += per_kv[0, 0].numel() * B
        out = weights.view(B, H, Hq // H * T, T).to(v.dtype) @ v  # GQA: the group shares its K/V
        return out.view(B, Hq, T, D).transpose(1, 2)

    def mean_mass(self) -> torch.Tensor:
        if not (self.count > 0).all():
            raise ValueError(f"no query had keys outside sink {self.sink} + local {self.local}: "
                             f"calibrate on longer text")
        return self.mass / self.count


@torch.no_grad()
def outside_window_mass(llm_or_model, samples, sink: int = 128, local: int = 256) -> torch.Tensor:
    """[layers, kv_heads] mean attention mass outside the window over token lists `samples`."""
    model = unwrap_model(llm_or_model)
    config = model.config
    step = StatsStep(config.num_layers, config.num_kv_heads, sink, local)
    device = next(model.parameters()).device
    for tokens in samples:
        ids = torch.as_tensor(tokens, dtype=torch.int64, device=device)[None]
        positions = torch.arange(ids.shape[1], device=device)[None]
        model(ids, positions, step, logits_at=positions[:, -1:])
    return step.mean_mass()


def calibrate_by_attention(llm_or_model, samples, sink: int = 128, local: int = 256,
                           sparsity: float = 0.5) -> HeadPattern:
    """Heads whose out-of-window mass is in the top (1 - sparsity) stay dense; the rest stream."""
    mass = outside_window_mass(llm_or_model, samples, sink, local)
    return HeadPattern.from_gates(mass.numpy(), sparsity, meta={
        "source": "attention-statistics", "sink": sink, "local": local, "samples": len(samples)})
