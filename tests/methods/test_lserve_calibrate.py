"""Calibration by attention statistics: heads that look outside the sink and local window are kept
dense, on a case whose heads we construct, and the whole model path runs on a tiny decoder."""

from __future__ import annotations

import torch

from turnkv.methods.lserve.calibrate_stats import StatsStep, calibrate_by_attention, outside_window_mass
from turnkv.methods.lserve.masks import outside_mask, streaming_mask
from turnkv.methods.lserve.passkey import passkey_samples
from turnkv.model.config import ModelConfig
from turnkv.model.decoder import Transformer

T, D, SINK, LOCAL = 64, 8, 4, 8


def constructed(retrieval_head: int):
    """q, k, v for 4 query heads over 2 KV heads: the retrieval head's queries all lock onto the key
    at position 20 (outside the window for most queries), the other head's onto the sink token."""
    gen = torch.Generator().manual_seed(retrieval_head)
    q = torch.zeros(1, T, 4, D)
    q[..., 0] = 1.0
    k = torch.randn(1, T, 2, D, generator=gen) * 0.01
    k[0, 20, retrieval_head, 0] = 30.0
    k[0, 0, 1 - retrieval_head, 0] = 30.0
    return q, k, torch.randn(1, T, 2, D, generator=gen)


def test_masks():
    inside, outside = streaming_mask(10, 2, 3), outside_mask(10, 2, 3)
    assert inside[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert outside[9].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    assert not (inside & outside).any() and ((inside | outside) == torch.ones(10, 10, dtype=torch.bool).tril()).all()


def test_heads_with_out_of_window_mass_are_dense():
    step = StatsStep(2, 2, SINK, LOCAL)
    for layer, retrieval in ((0, 0), (1, 1)):
        q, k, v = constructed(retrieval)
        out = step.attention(layer, q, k, v)
        # Its output is dense causal attention.
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, expected.transpose(1, 2))
    mass = step.mean_mass()
    assert mass[0, 0] > 0.6 and mass[1, 1] > 0.6
    assert mass[0, 1] < 0.01 and mass[1, 0] < 0.01
    from turnkv.methods.lserve.pattern import HeadPattern
    assert HeadPattern.from_gates(mass.numpy()).streaming.tolist() == [[False, True], [True, False]]


def tiny_model():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    return Transformer(config).eval()


def test_model_calibration_runs_and_matches_direct_measurement():
    model = tiny_model()
    # Every query head becomes a scaled copy of its KV head's key projection, so it attends to its
    # own token (inside the local window): a local head. Then layer 0's KV head 1 loses its queries:
    # its attention is uniform, most of its mass lies outside the window, and it must stay dense.
    with torch.no_grad():
        for block in model.layers:
            w = block.self_attn.qkv_proj.weight
            for qh in range(4):
                w[qh * 8:(qh + 1) * 8] = 20 * w[32 + (qh // 2) * 8:32 + (qh // 2 + 1) * 8]
        model.layers[0].self_attn.qkv_proj.weight[2 * 8:4 * 8] = 0
    samples = [s.tokens for s in passkey_samples(None, 2, 96, vocab_size=64, seed=0)]
    mass = outside_window_mass(model, samples, SINK, LOCAL)
    assert mass.shape == (2, 2) and ((mass >= 0) & (mass <= 1)).all()
    T = len(samples[0])
    rows = torch.arange(T) >= SINK + LOCAL
    uniform = (outside_mask(T, SINK, LOCAL).float().sum(1) / (torch.arange(T) + 1))[rows].mean()
    assert abs(mass[0, 1].item() - uniform.item()) < 0.02
    pattern = calibrate_by_attention(model, samples, SINK, LOCAL, sparsity=0.75)
    assert mass.flatten().topk(2).indices[0] == 1  # layer 0, head 1 looks outside the most
    assert pattern.streaming.sum() == 3 and not pattern.streaming[0, 1]
    assert pattern.meta["source"] == "attention-statistics"
