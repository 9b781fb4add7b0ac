"""Which part of the model each rank holds (turnkv/model/parallel.py): heads, intermediate size and
vocabulary split without overlap or gap, KV heads replicated past their count."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from turnkv.errors import ModelLoadError
from turnkv.model.config import ModelConfig
from turnkv.model.load import empty_model
from turnkv.model.parallel import Shard, shard_config, shard_model

CONFIG = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=4, attention_bias=True)


def test_heads_and_ranges():
    ranks = [Shard(r, 2, CONFIG) for r in range(2)]
    assert [list(s.q_heads) for s in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [s.kv_heads.tolist() for s in ranks] == [[0, 1], [2, 3]]
    assert [s.intermediate for s in ranks] == [range(0, 24), range(24, 48)]
    assert [s.vocab for s in ranks] == [range(0, 51), range(51, 102)]  # the last runs one past 101
    eight = [Shard(r, 8, CONFIG) for r in range(8)]
    assert [s.kv_heads.tolist() for s in eight] == [[0], [0], [1], [1], [2], [2], [3], [3]]
    assert eight[0].replicas == 2 and ranks[0].replicas == 1
    local = shard_config(ranks[1])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (4, 2, 24, 101)


@pytest.mark.parametrize("size, message", [(3, "query heads"), (16, "query heads")])
def test_sizes_that_do_not_split(size, message):
    with pytest.raises(ModelLoadError, match=message):
        Shard(0, size, CONFIG)
    with pytest.raises(ModelLoadError, match="KV heads"):
        Shard(0, 2, replace(CONFIG, num_heads=6, num_kv_heads=3))
    with pytest.raises(ModelLoadError, match="intermediate"):
        Shard(0, 2, replace(CONFIG, intermediate_size=47))


def _random_model(config):
    model = empty_model(config, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("tied", [False, True])
def test_the_shards_put_together_are_the_model(size, tied):
    """Rows of q/k/v, gate/up and the vocabulary, columns of o_proj and down_proj: the ranks' pieces,
    in rank order (one per replica group for KV heads), are the whole model's weights."""
    config = replace(CONFIG, tie_word_embeddings=tied)
    model = _random_model(config)
    shards = [shard_model(model, Shard(r, size, config)) for r in range(size)]
    D, Hq, Hkv, I = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    first_of_kv = [s for r, s in enumerate(shards) if r % s.shard.replicas == 0]
    for i, block in enumerate(model.layers):
        local = [s.layers[i] for s in shards]
        q, k, v = block.self_attn.qkv_proj.weight.split([Hq * D, Hkv * D, Hkv * D])
        parts = [b.self_attn.qkv_proj.weight.split([b.self_attn.num_heads * D, b.self_attn.num_kv_heads * D,
                                                    b.self_attn.num_kv_heads * D]) for b in local]
        assert torch.equal(torch.cat([p[0] for p in parts]), q)
        kv_parts = [p for s, p in zip(shards, parts) if s in first_of_kv]
        assert torch.equal(torch.cat([p[1] for p in kv_parts]), k)
        assert torch.equal(torch.cat([p[2] for p in kv_parts]), v)
        for s, p in zip(shards, parts):  # a replica holds its group's KV head
            heads = s.shard.kv_heads
            assert torch.equal(p[1], k.view(Hkv, D, -1)[heads].reshape(-1, k.shape[1]))
        assert torch.equal(torch.cat([b.self_attn.o_proj.weight for b in local], dim=1), block.self_attn.o_proj.weight)
        gate, up = block.mlp.gate_up_proj.weight.split([I, I])
        halves = [b.mlp.gate_up_proj.weight.split([I // size, I // size]) for b in local]
        assert torch.equal(torch.cat([h[0] for h in halves]), gate)
        assert torch.equal(torch.cat([h[1] for h in halves]), up)
        assert torch.equal(torch.cat([b.mlp.down_proj.weight for b in local], dim=1), block.mlp.down_proj.weight)
        assert all(torch.equal(b.input_layernorm.weight, block.input_layernorm.weight) for b in local)
    embed = torch.cat([s.embed_tokens.weight for s in shards])
    head = torch.cat([s.lm_head.weight for s in shards])
    assert torch.equal(embed[: config.vocab_size], model.embed_tokens.weight)
    assert torch.equal(head[: config.vocab_size], model.lm_head.weight)
    assert not embed[config.vocab_size:].any()  # padding rows of the last rank
    assert all((s.lm_head.weight is s.embed_tokens.weight) == tied for s in shards)


def test_a_ranks_streaming_heads_are_c_ordered_rows():
    """A rank's streaming-head flags are its KV heads' columns of the whole pattern, in C order: the
    chunk kernel takes one layer's windows ([H] int32) as a contiguous row."""
    import numpy as np

    from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill
    from turnkv.methods.chunk_windows import NO_WINDOW

    whole = StreamingHeadsPrefill(pattern="random").flags(2, 4)
    for rank in range(2):
        method = StreamingHeadsPrefill(pattern="random")
        method.bind(2, Shard(rank, 2, CONFIG))
        flags = method.flags(2, 2)
        assert np.array_equal(flags, whole[:, 2 * rank : 2 * rank + 2]) and flags.flags.c_contiguous
        windows = torch.from_numpy(np.where(flags, 16, NO_WINDOW)).to(torch.int32)  # chunk_windows' form
        assert all(row.is_contiguous() for row in windows)
