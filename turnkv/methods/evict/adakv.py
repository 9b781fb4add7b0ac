"""Ada-KV: head-wise adaptive budgets over any scorer (Feng et al., arXiv 2407.11550).

One top-k over the scores of all heads of a layer gives each head's share f_i of the layer's best
tokens; a safeguard `alpha` mixes it with the uniform share b so that no head starves. rule="code"
(default, the official code): round((1 - alpha) f_i + alpha b); "paper": alpha f_i + (1 - alpha) b;
"kvpress": each head's own top int(alpha n) first, then one top-k over the rest. Largest-remainder
rounding meets the layer's budget exactly. Design: docs/methods/adakv.md"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict.counts import fit_counts, protected_and_capacity
from turnkv.methods.protocols import Allocator
from turnkv.methods.registry import register

RULES = ("code", "paper", "kvpress")


@register("allocator", "adakv")
@dataclass
class AdaKVAllocator(Allocator):
    """Ada-KV head-wise adaptive budgets: one top-k over all heads of a layer, with a safeguard."""

    alpha: float = 0.2
    rule: str = "code"

    def __post_init__(self):
        if not 0 <= self.alpha <= 1:
            raise ValueError("alpha must be in [0, 1]")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}")

    def allocate(self, scores: torch.Tensor, total: int) -> torch.Tensor:
        protected, free = protected_and_capacity(scores)
        H = scores.shape[0]
        budget = min(total - int(protected.sum()), int(free.sum()))
        if budget <= 0:
            return protected
        competing = torch.where(torch.isfinite(scores), scores.float(), float("-inf"))
        uniform = budget / H
        if self.rule == "kvpress":
            n_safe = int(total // H * self.alpha)  # of each head's top tokens, its protected ones first
            forced = torch.minimum((n_safe - protected).clamp(min=0), free)
            rest = competing.clone()
            ranks = rest.argsort(dim=1, descending=True).argsort(dim=1)
            rest[ranks < forced.to(rest.device)[:, None]] = float("-inf")  # each head's forced tokens are taken
            desired = forced.double() + self.global_share(rest, budget - int(forced.sum())).double()
        else:
            f = self.global_share(competing, budget).double()
            if self.rule == "code":
                desired = (1 - self.alpha) * f + self.alpha * uniform
            else:
                desired = self.alpha * f + (1 - self.alpha) * uniform
        return protected + fit_counts(desired, free, budget)

    @staticmethod
    def global_share(scores: torch.Tensor, k: int) -> torch.Tensor:
        """f_i: how many of the layer's top-k finite scores (over all heads) fall in head i, as [H] on
        the CPU. The top-k runs where the scores are."""
        H, S = scores.shape
        top = scores.reshape(-1).topk(min(k, scores.numel())).indices
        finite = torch.isfinite(scores.reshape(-1)[top])  # k may exceed the finite scores: they rank first
        return torch.bincount(top // S, weights=finite.double(), minlength=H).round().long().cpu()
