"""Tensor parallelism of the decoder, Megatron style: one rank's shard of the weights and its layers.

Each of N ranks holds:
- its query heads [r Hq/N, (r+1) Hq/N) and the KV heads they read: Hkv/N heads when N divides Hkv,
  else (N a multiple of Hkv) the one KV head of its query heads, which N/Hkv ranks then hold alike;
- the rows of the fused q/k/v and gate/up projections of those heads and of its slice of the
  intermediate size (column parallel), and the matching columns of o_proj and down_proj (row
  parallel, whose partial sums one all-reduce adds: one after attention, one after the MLP);
- a slice of the vocabulary for the embedding (rows outside it give zeros; an all-reduce adds the
  slices) and for the LM head (an all-gather puts the full logits on every rank).
Norms and RoPE frequencies are whole on every rank.

The shard's model is a Transformer built from `shard_config` (its heads and intermediate size are
the rank's, its vocabulary the whole model's, since the logits it returns are whole), so everything
downstream (the page pool, the attention step, the methods) sees the rank's KV heads as the model's.
The collectives run over `Shard.group`, a process group of the N ranks (None: torch.distributed's
default group).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from turnkv.errors import ModelLoadError
from turnkv.model.config import ModelConfig
from turnkv.model.decoder import Linear, Transformer


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` ranks of a model whose whole config is `config`."""

    rank: int
    size: int
    config: ModelConfig
    group: object = field(default=None, compare=False, repr=False)  # a process group; None: the default one

    def __deepcopy__(self, memo):
        return self  # immutable, and its process group cannot be copied (a conversation's clone copies it)

    def __post_init__(self):
        c, n = self.config, self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is not one of {n} ranks")
        if c.num_heads % n:
            raise ModelLoadError(f"tensor_parallel={n} must divide the model's {c.num_heads} query heads")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ModelLoadError(f"tensor_parallel={n} must divide the model's {c.num_kv_heads} KV heads or be a "
                                 f"multiple of them")
        if c.intermediate_size % n:
            raise ModelLoadError(f"tensor_parallel={n} must divide the intermediate size {c.intermediate_size}")

    @property
    def q_heads(self) -> range:
        """The global query heads of this rank."""
        per = self.config.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> np.ndarray:
        """The global KV heads of this rank, ascending: those its query heads read."""
        group = self.config.num_heads // self.config.num_kv_heads
        return np.unique(np.array(self.q_heads) // group)

    @property
    def replicas(self) -> int:
        """How many ranks hold each KV head (1 when N divides the KV heads)."""
        return max(1, self.size // self.config.num_kv_heads)

    @property
    def intermediate(self) -> range:
        per = self.config.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab(self) -> range:
        """This rank's rows of the embedding and LM head; the last rank's may run past the vocabulary
        (padding rows of zeros) so that every rank holds ceil(V / N)."""
        per = -(-self.config.vocab_size // self.size)
        return range(self.rank * per, (self.rank + 1) * per)


def shard_config(shard: Shard) -> ModelConfig:
    """The config of one rank's decoder: its heads and intermediate size, the whole vocabulary."""
    c = shard.config
    return replace(c, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                   intermediate_size=len(shard.intermediate))


_SKIPPING = threading.local()  # .on: this thread's forwards run no collectives (collectives_skipped)


@contextmanager
def collectives_skipped():
    """Inside (on this thread): the decoder's collectives do nothing. all_reduce leaves x as it is and the LM
    head repeats the rank's own logits, so a forward gives wrong values of the right shapes. For a CUDA
    graph's warm-up run (engine/cuda_graphs.py): the ranks must run the same collectives in the same order,
    and one rank may capture a graph (a warm-up, then the capture) where another replays one."""
    with _thread_setting(_SKIPPING, "on", True):
        yield


_REFUSED = threading.local()  # .what: this thread runs no collective (collectives_refused), and why


@contextmanager
def collectives_refused(what: str):
    """Inside (on this thread): a collective raises RuntimeError naming `what` instead of waiting for
    ranks that will never join it. For work that runs off the ranks' common order (a background pack)."""
    with _thread_setting(_REFUSED, "what", what):
        yield


@contextmanager
def _thread_setting(local: threading.local, name: str, value):
    """Set `name` of a thread-local to `value` inside, and back to what it was (or None) after."""
    before = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)


def _refuse() -> None:
    what = getattr(_REFUSED, "what", None)
    if what is not None:
        raise RuntimeError(f"a collective in {what}, which runs none (the other ranks would not join it)")


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x. Synchronous on the current stream (NCCL: its own stream,
    joined by the current one), so a CUDA graph captures it."""
    _refuse()
    if not getattr(_SKIPPING, "on", False):
        dist.all_reduce(x, group=shard.group)
    return x


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks: the local product, then the sum
    over ranks. No bias (o_proj and down_proj have none)."""

    def __init__(self, in_features: int, out_features: int, shard: Shard):
        super().__init__(in_features, out_features, bias=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x).contiguous(), self.shard)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of the shard's vocabulary; the other ids embed as zeros, and the sum over
    ranks gives every id its row. weight: [len(shard.vocab), hidden]."""

    def __init__(self, hidden: int, shard: Shard):
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(len(shard.vocab), hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.shard.vocab.start
        local = ids - start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside[..., None], 0.0), self.shard)


class VocabParallelHead(Linear):
    """The LM head rows of the shard's vocabulary; the logits of every rank are gathered, so each rank
    returns [..., vocab_size], the same on every rank."""

    def __init__(self, hidden: int, shard: Shard):
        super().__init__(hidden, len(shard.vocab), bias=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        if getattr(_SKIPPING, "on", False):
            return torch.cat([local] * self.shard.size, dim=-1)[..., : self.shard.config.vocab_size]
        _refuse()
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local, group=self.shard.group)
        return torch.cat(parts, dim=-1)[..., : self.shard.config.vocab_size]


def _rows(weight: torch.Tensor, pieces: list[tuple[int, range]]) -> torch.Tensor:
    """The rows of weight [out, ...] that `pieces` name, concatenated in order: each piece is (the
    first row of a block, a range of rows within that block)."""
    return torch.cat([weight[start + r.start : start + r.stop] for start, r in pieces])


def _scaled(r: range, unit: int) -> range:
    return range(r.start * unit, r.stop * unit)


@torch.no_grad()
def shard_model(model: Transformer, shard: Shard) -> Transformer:
    """A new decoder holding `shard`'s part of `model` (the whole model, config shard.config), on the
    model's device and dtype. The whole model is left as it was."""
    full = model.config
    if full != shard.config:
        raise ValueError("the shard describes another model's config")
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    config = shard_config(shard)
    with torch.device("meta"):
        local = Transformer(config)
        local.embed_tokens = VocabParallelEmbedding(full.hidden_size, shard)
        local.lm_head = VocabParallelHead(full.hidden_size, shard)
        for block in local.layers:
            block.self_attn.o_proj = RowParallelLinear(config.num_heads * config.head_dim, full.hidden_size, shard)
            block.mlp.down_proj = RowParallelLinear(config.intermediate_size, full.hidden_size, shard)
    local = local.to(dtype=dtype).to_empty(device=device)
    local.inv_freq = model.inv_freq.clone()
    local.shard = shard  # which part of the whole model this is (a plain Transformer has no `shard`)

    D, Hq, Hkv, I = full.head_dim, full.num_heads, full.num_kv_heads, full.intermediate_size
    kv = shard.kv_heads
    kv_range = range(int(kv[0]), int(kv[-1]) + 1)  # contiguous: the heads of consecutive query heads
    qkv_rows = [(0, _scaled(shard.q_heads, D)), (Hq * D, _scaled(kv_range, D)), ((Hq + Hkv) * D, _scaled(kv_range, D))]
    vocab = shard.vocab
    local.embed_tokens.weight.copy_(_vocab_rows(model.embed_tokens.weight, vocab))
    if config.tie_word_embeddings:
        local.lm_head.weight = local.embed_tokens.weight
    else:
        local.lm_head.weight.copy_(_vocab_rows(model.lm_head.weight, vocab))
    local.norm.weight.copy_(model.norm.weight)
    for mine, whole in zip(local.layers, model.layers):
        mine.input_layernorm.weight.copy_(whole.input_layernorm.weight)
        mine.post_attention_layernorm.weight.copy_(whole.post_attention_layernorm.weight)
        attn, whole_attn = mine.self_attn, whole.self_attn
        attn.qkv_proj.weight.copy_(_rows(whole_attn.qkv_proj.weight, qkv_rows))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias.copy_(_rows(whole_attn.qkv_proj.bias, qkv_rows))
        q_cols = _scaled(shard.q_heads, D)
        attn.o_proj.weight.copy_(whole_attn.o_proj.weight[:, q_cols.start : q_cols.stop])
        inter = shard.intermediate
        mine.mlp.gate_up_proj.weight.copy_(_rows(whole.mlp.gate_up_proj.weight, [(0, inter), (I, inter)]))
        mine.mlp.down_proj.weight.copy_(whole.mlp.down_proj.weight[:, inter.start : inter.stop])
    return local.eval()


def _vocab_rows(weight: torch.Tensor, vocab: range) -> torch.Tensor:
    """weight's rows in `vocab`, with zero rows where it runs past the vocabulary."""
    rows = weight[vocab.start : vocab.stop]
    return F.pad(rows, (0, 0, 0, len(vocab) - rows.shape[0]))


def gather_heads(x: torch.Tensor, shard: Shard, dim: int) -> torch.Tensor:
    """x holds this rank's KV heads along `dim` (the same shape on every rank) -> the whole model's KV
    heads along `dim`, each taken from the first rank that holds it. Every rank gets the same tensor."""
    _refuse()
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    if shard.replicas == 1:
        return torch.cat(parts, dim=dim)
    # Each rank holds one KV head, which ranks [h * replicas, (h + 1) * replicas) share.
    return torch.cat(parts[:: shard.replicas], dim=dim)


def all_max(value: int, shard: Shard, device: torch.device) -> int:
    """The largest of every rank's `value`, through a tensor on `device` (the backend's: NCCL takes CUDA
    tensors only)."""
    _refuse()
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=shard.group)
    return int(t)


def host_max(values: list[int], group) -> list[int]:
    """Each of `values` (ints) at its largest over the ranks of `group`, which takes host tensors (gloo):
    no device stream waits for it. Inside collectives_skipped: the values as they are (no collective)."""
    if getattr(_SKIPPING, "on", False):
        return [int(v) for v in values]
    _refuse()
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def rank0_values(values: list[float], shard: Shard, device: torch.device) -> list[float]:
    """Rank 0's `values` on every rank (an all-reduce of float64 in which the other ranks add zeros), for
    decisions that must agree across ranks but derive from each rank's own measurements."""
    mine = values if shard.rank == 0 else [0.0] * len(values)
    return all_reduce(torch.tensor(mine, dtype=torch.float64, device=device), shard).tolist()
