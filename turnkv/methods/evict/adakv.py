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

    def allocate_layers(self, scores: torch.Tensor, totals) -> torch.Tensor:
        protected, free = protected_and_capacity(scores)  # [T, H] each
        H = scores.shape[1]
        totals = torch.as_tensor([int(x) for x in totals], dtype=torch.int64)
        budget = torch.minimum(totals - protected.sum(dim=1), free.sum(dim=1))  # [T]
        competing = torch.where(torch.isfinite(scores), scores.float(), float("-inf"))
        uniform = budget.double()[:, None] / H
        if self.rule == "kvpress":
            n_safe = ((totals // H).double() * self.alpha).floor().long()  # of each head's top tokens, protected first
            forced = torch.minimum((n_safe[:, None] - protected).clamp(min=0), free)
            ranks = competing.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
            rest = competing.masked_fill(ranks < forced.to(scores.device)[..., None], float("-inf"))  # taken
            desired = forced.double() + self.global_share(rest, budget - forced.sum(dim=1)).double()
        else:
            f = self.global_share(competing, budget).double()
            if self.rule == "code":
                desired = (1 - self.alpha) * f + self.alpha * uniform
            else:
                desired = self.alpha * f + (1 - self.alpha) * uniform
        return protected + fit_counts(desired, free, budget.clamp(min=0))

    @staticmethod
    def global_share(scores: torch.Tensor, k) -> torch.Tensor:
        """f_i: how many of a layer's top-k finite scores (over all its heads) fall in head i. scores
        [H, S] and k an int -> [H], or [T, H, S] and k [T] -> [T, H]; on the CPU. Ties rank the lower
        (head, token) index first; the sort runs where the scores are."""
        one = scores.dim() == 2
        scores = scores[None] if one else scores
        T, H, S = scores.shape
        k = torch.as_tensor(k, dtype=torch.int64).reshape(-1).clamp(min=0)
        depth = min(int(k.max()) if k.numel() else 0, H * S)
        values, top = scores.reshape(T, H * S).sort(dim=1, descending=True, stable=True)
        values, top = values[:, :depth], top[:, :depth]
        # k may exceed the finite scores: they rank first, and only they count.
        taken = (torch.arange(depth, device=scores.device) < k.to(scores.device)[:, None]) & torch.isfinite(values)
        heads = top // S + torch.arange(T, device=scores.device)[:, None] * H
        share = torch.bincount(heads[taken], minlength=T * H).view(T, H).cpu()
        return share[0] if one else share
