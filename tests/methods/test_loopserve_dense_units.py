"""LoopServe's dense units beside units that keep their lines: the dense pass runs only over the KV
heads that hold a dense unit, and every row equals its own path's (dense heads: causal attention over
every key; the others: their lines)."""

from __future__ import annotations

import pytest
import torch

from turnkv.attention import lines, reference
from turnkv.methods.loopserve import prefill as loopserve_prefill
from turnkv.methods.loopserve.prefill import LoopServePrefill


def make_keys(B=1, H=3, G=2, history=16, T=24, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = history + T
    q = torch.randn(B, H * G, T, D, generator=gen)
    k, v = torch.randn(B, H, S, D, generator=gen), torch.randn(B, H, S, D, generator=gen)
    q_pos = torch.arange(history, S)[None].expand(B, T).contiguous()
    k_pos = torch.arange(S)[None, None].expand(B, H, S).contiguous()
    return lines.Keys(q, k, v, q_pos, k_pos, None, history, S)


@pytest.mark.parametrize("per_q", [False, True])
def test_dense_units_beside_line_units(monkeypatch, per_q):
    keys = make_keys()
    B, Hq, T = keys.q.shape[:3]
    H, S = keys.k.shape[1], keys.k.shape[2]
    U = Hq if per_q else H
    gen = torch.Generator().manual_seed(1)
    vertical = torch.rand(B * U, S, generator=gen) < 0.2
    slash = torch.rand(B * U, S, generator=gen) < 0.2
    slash[:, 0] = True
    dense = torch.zeros(B, U, dtype=torch.bool)
    dense[0, 1] = True  # per KV head: head 1; per query head: query head 1, in KV head 0
    layout = lines.kernel_layout(keys)
    assert layout is not None
    causal = torch.full((B, U), 1.0, dtype=torch.float64)
    seen = []
    every = loopserve_prefill._every_cell
    monkeypatch.setattr(loopserve_prefill, "_every_cell",
                        lambda q, k, v: seen.append(k.shape[1]) or every(q, k, v))
    out, computed, _ = LoopServePrefill()._attend_dense_units(keys, vertical, slash, per_q, dense, causal, layout)
    assert seen == [1]  # one KV head's dense pass, not all three
    lined, line_computed, _ = lines.line_attention(keys, vertical, slash, per_q, layout=layout)
    full = reference.causal_suffix(keys.q, keys.k, keys.v)
    per_head = dense.repeat_interleave(Hq // U, dim=1)[0]  # [Hq]
    for h in range(Hq):
        want = full[:, h] if per_head[h] else lined[:, h]
        torch.testing.assert_close(out[:, h], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(computed[~dense], line_computed[~dense]) and torch.equal(computed[dense], causal[dense])
