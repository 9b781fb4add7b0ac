"""An eviction's layer-wide decisions under tensor parallelism, where each rank holds some KV heads.

A layer's budget, its protected-token surplus and its allocator (Ada-KV's top-k over all heads, or a
uniform split with the remainders of short heads) see every head of the layer. Each rank scores its
own heads (a scorer that reads one KV head's keys and its query group gives the scores it would at
N=1), then the scores and counts are gathered so that every rank computes the same layer-wide
decisions over the whole model's heads, and keeps its own heads' part. The gathered scores are
[layers, heads, longest head] floats: exact, and more traffic than merging per-rank top-k candidates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnkv.model.parallel import Shard, all_max, gather_heads


def gathered_scores(scores: torch.Tensor, pos: torch.Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's scores and positions [T, local heads, S] -> the whole model's [T, heads, S'], padded
    (with -inf scores and -1 positions) to S', the longest head of any rank."""
    longest = all_max(scores.shape[-1], shard, scores.device)
    pad = longest - scores.shape[-1]
    scores = F.pad(scores, (0, pad), value=float("-inf"))
    pos = F.pad(pos, (0, pad), value=-1)
    return gather_heads(scores, shard, dim=1), gather_heads(pos, shard, dim=1)


def own_heads(x: torch.Tensor, shard: Shard, length: int | None = None) -> torch.Tensor:
    """The whole model's [T, heads, ...] -> this rank's heads [T, local heads, ...], cut to `length`
    along the last dimension when given."""
    heads = torch.from_numpy(shard.kv_heads).to(x.device)
    x = x.index_select(1, heads)
    return x if length is None else x[..., :length]
