"""ExpectedAttention: keep the keys that future queries are expected to attend to.

Follows kvpress's ExpectedAttentionPress (Devoto et al., arXiv 2510.00636; the authors' code). A key's
score is its expected softmax weight under the pre-RoPE queries' mean and covariance (divided by N),
rotated by the RoPE averaged over the next `future` positions from the conversation's absolute
position: exp(k.mu/sqrt(d) + k^T Sigma k / (2d)), normalised over the non-sink keys, averaged over the
KV group's query heads, plus `epsilon`, times ||v||. The `sinks` first tokens always stay.
Parameters (queries, window, future, sinks, use_covariance, use_vnorm, epsilon, compat):
docs/methods/baselines.md#expectedattention"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.compat import COMPATS
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register
from turnkv.methods.window import rotate_half, unrotate

QUERIES = ("all", "window")


@register("scorer", "expected_attention")
@dataclass
class ExpectedAttentionScorer(Scorer):
    """ExpectedAttention: expected weight of future queries (mean/covariance, averaged RoPE) times ||v||."""

    queries: str = "all"
    window: int = 64
    future: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    compat: str = "authors"

    def __post_init__(self):
        if self.queries not in QUERIES:
            raise ValueError(f"queries must be one of {', '.join(QUERIES)}")
        if self.compat not in COMPATS:
            raise ValueError(f"compat must be one of {', '.join(COMPATS)}")
        if self.future < 1 or self.window < 1 or self.sinks < 0:
            raise ValueError("future and window must be >= 1, sinks >= 0")

    @property
    def query_moments(self) -> int | None:
        return self.sinks if self.queries == "all" else None

    def statistics(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean [Hq, D] and covariance [Hq, D, D] (divided by N) of the pre-RoPE queries, float64."""
        if self.queries == "all" and view.moments is not None:
            count, total, outer = (x.double() for x in view.moments)
            n = count.clamp(min=1)
            mean = total / n
            return mean, outer / n - mean[:, :, None] * mean[:, None, :]
        pre = unrotate(view.queries, view.query_positions, view.inv_freq)  # [W, Hq, D]
        kept = pre[view.query_positions.to(pre.device) >= self.sinks]
        pre = kept if kept.shape[0] else pre
        mean = pre.mean(dim=0)
        centered = pre - mean
        return mean, torch.einsum("whd,whe->hde", centered, centered) / pre.shape[0]

    def score(self, view: LayerView) -> torch.Tensor:
        mean, cov = self.statistics(view)
        D = mean.shape[-1]
        device = mean.device
        future = torch.arange(view.next_position, view.next_position + self.future, device=device).double()
        f_angles = future[:, None] * view.inv_freq.double().to(device)
        c = torch.cat((f_angles.cos(), f_angles.cos()), -1).mean(0)  # averaged rotation: x -> c*x + s*rot(x)
        s = torch.cat((f_angles.sin(), f_angles.sin()), -1).mean(0)
        # Row-vector form: x -> x @ rotation, where rotate_half(x) == x @ rotate_half(I).
        rotation = torch.diag(c) + rotate_half(torch.eye(D, dtype=torch.float64, device=device)) @ torch.diag(s)
        mu = mean @ rotation  # [Hq, D]
        keys = view.keys.double().to(device)
        H = keys.shape[0]
        G = mu.shape[0] // H
        logits = torch.einsum("hgd,hsd->hgs", mu.view(H, G, D), keys) / D**0.5
        if self.use_covariance:
            cov = rotation.T @ cov @ rotation  # [Hq, D, D]
            quad = torch.einsum("hsd,hgde,hse->hgs", keys, cov.view(H, G, D, D), keys)
            logits = logits + quad / (2 * D)
        sink = (view.positions < self.sinks).to(device)
        competing = view.valid.to(device) & ~sink
        logits = logits.masked_fill(~competing[:, None], float("-inf"))
        probs = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)  # a head of sinks only: no weights
        scores = probs.mean(dim=1) + self.epsilon  # [H, S]
        if self.use_vnorm:
            scores = scores * view.values.double().to(device).norm(dim=-1)
        return scores.float().masked_fill(sink, float("inf")).to(view.keys.device)
