"""DuoAttention-style gate optimisation on a tiny decoder: the loss goes down, the L1 term drives
the gates of heads that do not matter to 0 while heads that matter stay up, and the model is frozen."""

from __future__ import annotations

import pytest
import torch

from turnkv.methods.lserve.gates import GatedStep, final_hidden, optimize_gates
from turnkv.methods.lserve.passkey import passkey_samples
from turnkv.model.config import ModelConfig
from turnkv.model.decoder import Transformer


def tiny_model():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    return Transformer(config).eval()


def test_gated_step_mixes_full_and_streaming():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, n, 8, generator=gen) for n in (4, 2, 2))
    ones = GatedStep(torch.ones(1, 2), 2, 4).attention(0, q, k, v)
    zeros = GatedStep(torch.zeros(1, 2), 2, 4).attention(0, q, k, v)
    half = GatedStep(torch.full((1, 2), 0.5), 2, 4).attention(0, q, k, v)
    torch.testing.assert_close(ones, GatedStep(None, 2, 4).attention(0, q, k, v))
    torch.testing.assert_close(half, (ones + zeros) / 2)
    # Streaming: the last query sees keys 0, 1 and 16..19 only.
    keep = [0, 1, 16, 17, 18, 19]
    w = (torch.einsum("hd,shd->hs", q[0, -1], k[0, keep].repeat_interleave(2, 1)) * 8**-0.5).softmax(-1)
    torch.testing.assert_close(zeros[0, -1], torch.einsum("hs,shd->hd", w, v[0, keep].repeat_interleave(2, 1)))


def test_differentiable_forward_equals_the_model():
    model = tiny_model()
    tokens = torch.randint(0, 64, (1, 30))
    at = torch.tensor([3, 29])
    seen = []
    handle = model.norm.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        model(tokens, torch.arange(30)[None], GatedStep(None, 4, 8), logits_at=at[None])
    handle.remove()
    torch.testing.assert_close(final_hidden(model, tokens, at, GatedStep(None, 4, 8)), seen[0])


def test_gates_separate_muted_heads_from_live_ones():
    model = tiny_model()
    # Zero the output projection of layer 0 / KV head 1 and layer 1 / KV head 0 (their query heads'
    # columns): what those heads attend to cannot change the hidden states.
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight[:, 2 * 8:4 * 8] = 0
        model.layers[1].self_attn.o_proj.weight[:, 0:2 * 8] = 0
    before = [p.clone() for p in model.parameters()]
    samples = passkey_samples(None, 2, 96, num_keys=3, key_digits=4, vocab_size=64, seed=0)
    result = optimize_gates(model, steps=60, samples=samples, sink=4, local=8, reg_weight=0.01, lr=0.05)
    gates = result.gates
    assert gates[0, 1] < 0.05 and gates[1, 0] < 0.05
    assert gates[0, 0] > 0.3 and gates[1, 1] > 0.3
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < 0.5 * losses[0]
    assert result.history[-1]["reg"] < result.history[0]["reg"]
    assert result.pattern(0.5).streaming.tolist() == [[False, True], [True, False]]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_samples_must_exceed_the_window():
    samples = passkey_samples(None, 1, 40, vocab_size=64)
    with pytest.raises(ValueError, match="longer than sink"):
        optimize_gates(tiny_model(), steps=1, samples=samples, sink=16, local=64)
