"""Which path lines.line_attention takes on a GPU: the kernel for every line set in the kernel's layout,
a local window of slashes and scattered slashes alike. On CPU, uses_kernel is made to answer as it does
on CUDA and the kernel runs in Triton's interpreter; on a GPU the tensors live there."""

from __future__ import annotations

import torch

from turnkv.attention import lines
from turnkv.attention.triton import lines as kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _keys(n=96, T=40, Hq=4, H=2, D=16):
    torch.manual_seed(0)
    q = torch.randn(1, Hq, T, D, device=DEVICE)
    k, v = torch.randn(1, H, n, D, device=DEVICE), torch.randn(1, H, n, D, device=DEVICE)
    q_pos = torch.arange(n - T, n, device=DEVICE)[None]
    k_pos = torch.arange(n, device=DEVICE).expand(1, H, n)
    return lines.Keys(q, k, v, q_pos, k_pos, None, n - T, n)


def _run(monkeypatch, keys, slash):
    calls = []
    real = kernel.line_attention
    monkeypatch.setattr(lines, "uses_kernel", lambda device, force=False: True)  # as on CUDA
    monkeypatch.setattr(kernel, "line_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    vertical = torch.zeros(keys.q.shape[1], keys.k.shape[2], dtype=torch.bool, device=DEVICE)
    vertical[:, :4] = True
    out, computed, causal = lines.line_attention(keys, vertical, slash, True)
    ref, ref_computed, _ = lines.blockwise_attention(keys, lambda r: lines.line_mask(keys, vertical, slash, True, r))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(computed, ref_computed)
    return len(calls)


def test_a_window_of_slashes_takes_the_kernel(monkeypatch):
    keys = _keys()
    slash = torch.zeros(4, keys.end_position, dtype=torch.bool, device=DEVICE)
    slash[:, :20] = True  # one run per unit
    assert _run(monkeypatch, keys, slash) == 1


def test_scattered_slashes_take_the_kernel(monkeypatch):
    keys = _keys()
    slash = torch.zeros(4, keys.end_position, dtype=torch.bool, device=DEVICE)
    slash[:, :8] = True
    slash[:, 50] = True  # a second run of offsets: a second segment for the kernel
    assert _run(monkeypatch, keys, slash) == 1


def test_an_evicted_layout_takes_the_reference_path(monkeypatch):
    keys = _keys()
    keys = lines.Keys(keys.q, keys.k, keys.v, keys.q_pos, keys.k_pos.flip(-1), None, keys.first_position,
                      keys.end_position)  # entries no longer at their own positions
    slash = torch.zeros(4, keys.end_position, dtype=torch.bool, device=DEVICE)
    slash[:, :8] = True
    assert _run(monkeypatch, keys, slash) == 0
