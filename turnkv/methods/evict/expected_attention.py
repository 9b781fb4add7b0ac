"""ExpectedAttention: keep the keys that future queries are expected to attend to.

Based on kvpress's ExpectedAttentionPress (Devoto et al., arXiv 2510.00636). The observation window's
queries are rotated back to their pre-RoPE form; their mean and covariance model a future query,
which is rotated by the RoPE averaged over the next `future` positions (counted from the
conversation's absolute position, as multi-turn use needs). A key's score is its expected softmax
weight, exp(k.mu/sqrt(d) + k^T Sigma k / (2d)), normalised over the head's keys, times ||v||.

Parameters
----------
window : int, default 64
    Queries whose statistics model the future ones.
future : int, default 512
    Future positions the rotation is averaged over.
sinks : int, default 4
    First tokens of the conversation that always stay.
use_covariance : bool, default True
use_vnorm : bool, default True
epsilon : float, default 0.0
    Added to the scores before the value-norm rescaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@register("scorer", "expected_attention")
@dataclass
class ExpectedAttentionScorer(Scorer):
    """ExpectedAttention: expected weight of future queries (mean/covariance, averaged RoPE) times ||v||."""

    window: int = 64
    future: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def score(self, view: LayerView) -> torch.Tensor:
        q = view.queries.double()  # [W, Hq, D]
        D = q.shape[-1]
        angles = view.query_positions.double()[:, None] * view.inv_freq.double().to(q.device)
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
        pre_rope = q * cos - rotate_half(q) * sin  # the inverse rotation
        mean = pre_rope.mean(dim=0)  # [Hq, D]
        future = torch.arange(view.next_position, view.next_position + self.future, device=q.device).double()
        f_angles = future[:, None] * view.inv_freq.double().to(q.device)
        c = torch.cat((f_angles.cos(), f_angles.cos()), -1).mean(0)  # averaged rotation: x -> c*x + s*rot(x)
        s = torch.cat((f_angles.sin(), f_angles.sin()), -1).mean(0)
        # Row-vector form: x -> x @ rotation, where rotate_half(x) == x @ rotate_half(I).
        rotation = torch.diag(c) + rotate_half(torch.eye(D, dtype=torch.float64, device=q.device)) @ torch.diag(s)
        mu = mean @ rotation  # [Hq, D]
        keys = view.keys.double()
        H = keys.shape[0]
        G = q.shape[1] // H
        logits = torch.einsum("hgd,hsd->hgs", mu.view(H, G, D), keys) / D**0.5
        if self.use_covariance and q.shape[0] > 1:
            centered = pre_rope - mean
            cov = torch.einsum("whd,whe->hde", centered, centered) / (q.shape[0] - 1)
            cov = rotation.T @ cov @ rotation  # [Hq, D, D]
            quad = torch.einsum("hsd,hgde,hse->hgs", keys, cov.view(H, G, D, D), keys)
            logits = logits + quad / (2 * D)
        logits = logits.masked_fill(~view.valid[:, None], float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=1) + self.epsilon  # [H, S]
        if self.use_vnorm:
            scores = scores * view.values.double().norm(dim=-1)
        return scores.float().masked_fill(view.positions < self.sinks, float("inf"))
