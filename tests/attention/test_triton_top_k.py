"""The radix-select top-k kernel against torch.topk + sort: the same index sets (ties broken by the
lowest index), ascending, with indices past each row's history replaced by the padding value; over
rows with +inf, -inf, negative values, zeros and exact ties. In Triton's interpreter on CPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from turnkv.attention.triton.top_k import top_k_ascending  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(x, k, history, pad):
    """Ties at the k-th value resolved towards the lowest index, as the kernel does."""
    top = torch.argsort(x, dim=-1, descending=True, stable=True)[..., :k]  # stable: lower index first
    top = torch.where(top < history[..., None], top, pad)
    return top.sort(dim=-1).values


@pytest.mark.parametrize("n,k,block", [(5000, 64, 1024), (4096, 4096, 2048), (300, 7, 256)])
def test_top_k_matches_sorted_topk(n, k, block):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.rand(2, 3, n, generator=gen)
    x[0, 0, :5] = float("inf")  # sinks
    x[0, 1, n // 2 :] = float("-inf")  # past the history
    x[1, 0] = torch.randn(n, generator=gen)  # negatives
    x[1, 1] = torch.randint(0, 4, (n,), generator=gen).float()  # heavy exact ties
    x[1, 2, ::3] = 0.0
    history = torch.tensor([[n, n // 2, n], [n - 10, n, 1]], dtype=torch.int32)
    pad = 10**6
    got = top_k_ascending(x.to(DEVICE), k, history.to(DEVICE), pad, block=block).cpu()
    want = _expected(x, k, history, pad)
    assert torch.equal(got, want)
    # the set agrees with torch.topk wherever the k-th value has no tie
    plain = torch.topk(x[0, 2], k).indices.sort().values
    assert torch.equal(got[0, 2], plain)


def test_top_k_of_extreme_floats():
    x = torch.tensor([[0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf"), 1.0, -1.0]])
    got = top_k_ascending(x.to(DEVICE), 4, torch.tensor([10], dtype=torch.int32).to(DEVICE), -1, block=16).cpu()
    assert got.tolist() == [[2, 4, 6, 8]]  # inf, 3.4e38, 1.0, 1e-45
