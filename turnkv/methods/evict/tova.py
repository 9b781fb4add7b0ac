"""TOVA: keep the tokens the newest query attends to most.

Based on Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104). As in the authors'
code, the score is the newest query's attention (softmax over every key it sees, its own included)
averaged over all query heads of the layer: one ranking for the layer, which every KV head keeps.

Parameters
----------
group : str, default "layer"
    "layer": average over every query head of the layer (the authors' code, and kvpress).
    "kv_head": average over the query heads of each KV group, so that each KV head keeps its own
    tokens (GQA-aware).
compat : str, default "authors"
    "kvpress": kvpress's TOVAPress, which also always keeps the newest token; under "authors" it
    competes with its own attention weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.methods.evict import across_ranks
from turnkv.methods.evict.compat import COMPATS
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import Scorer
from turnkv.methods.registry import register

GROUPS = ("layer", "kv_head")


@register("scorer", "tova")
@dataclass
class TOVAScorer(Scorer):
    """TOVA: attention weights of the last query, averaged over the layer's query heads."""

    window: int = 1
    group: str = "layer"
    compat: str = "authors"

    def __post_init__(self):
        if self.window < 1:
            raise ValueError("window must be >= 1 (TOVA reads the newest query)")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}")
        if self.compat not in COMPATS:
            raise ValueError(f"compat must be one of {', '.join(COMPATS)}")

    def score(self, view: LayerView) -> torch.Tensor:
        last = view.window_attention()[:, -1]  # [Hq, S]
        if self.group == "kv_head":
            scores = view.group_mean(last)
        else:
            # One ranking for the layer: each KV head's entries take the layer-mean weight of the
            # position they hold (heads may hold different positions after an earlier compression).
            scores = layer_mean_by_position(view, last)
        if self.compat == "kvpress":
            scores = scores.masked_fill(view.positions == view.query_positions[-1], float("inf"))
        return scores


def layer_mean_by_position(view: LayerView, per_query_head: torch.Tensor) -> torch.Tensor:
    """[Hq, S] weights -> [H, S]: for each entry, the mean over all Hq query heads of the weight they
    give that entry's position (0 from a head whose KV head no longer holds it). Under tensor
    parallelism the mean is over every rank's query heads."""
    H, S = view.positions.shape
    G = per_query_head.shape[0] // H
    per_kv = per_query_head.view(H, G, S).sum(dim=1)  # [H, S], summed over each group
    pos = torch.where(view.valid, view.positions, -1)
    num_query_heads = per_query_head.shape[0]
    if view.shard is not None:
        per_kv, pos = across_ranks.gathered_scores(per_kv[None], pos[None], view.shard)
        per_kv, pos = per_kv[0].masked_fill(pos[0] < 0, 0.0), pos[0]
        num_query_heads = view.shard.config.num_heads
    flat_pos, flat_w = pos.reshape(-1), per_kv.reshape(-1)
    uniq, inverse = torch.unique(flat_pos, return_inverse=True)
    total = torch.zeros(uniq.numel(), dtype=flat_w.dtype, device=flat_w.device).index_add_(0, inverse, flat_w)
    mean = (total[inverse] / num_query_heads).view(pos.shape)
    return mean if view.shard is None else across_ranks.own_heads(mean[None], view.shard, S)[0]
