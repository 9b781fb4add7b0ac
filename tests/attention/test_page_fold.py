"""The page-summary fold of a step's keys (attention/triton/page_fold.py, PageSummaries.update_runs)
equals PageSummaries.update bit for bit: runs that start at page starts and inside pages, chunk
lengths that are not multiples of the logical page, several sequences and heads, a subset of heads,
pages in shuffled order, bf16 / fp16 / fp32 keys, keys read through strided views, logical pages of
8 and 16 tokens in pool pages of 16 and 32. On CPU in Triton's interpreter, on CUDA compiled."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention.triton.page_fold import fold_runs  # noqa: E402
from turnkv.kv.pool import PagePool  # noqa: E402
from turnkv.methods.lserve import summaries as summaries_module  # noqa: E402
from turnkv.methods.lserve.summaries import PageSummaries  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def run_case(B, H, D, T, before, page_size, dtype, seed, key_dtype=None):
    """B sequences of H heads; head (b, h) holds before[b * H + h] tokens and writes T more, its
    pages in shuffled pool order. -> a pool in `dtype` (the statistics'), the step's keys [B, T, H,
    D] in key_dtype (default dtype) as a strided view of a fused projection, the slots [B, H, T]."""
    gen = torch.Generator().manual_seed(seed)
    before = torch.tensor(before).view(B, H)
    width = -(-(int(before.max()) + T) // page_size)
    num_pages = B * H * width + 3
    table = torch.randperm(num_pages, generator=gen)[: B * H * width].view(B, H, width)
    index = before[..., None] + torch.arange(T)  # [B, H, T] the tokens' places in their heads
    slots = table.gather(2, index // page_size) * page_size + index % page_size
    fused = torch.randn(B, T, 3 * H, D, generator=gen).to(key_dtype or dtype)  # q, k, v of one projection
    k = fused[:, :, H : 2 * H]
    pool = PagePool(1, H, D, num_pages, page_size=page_size, dtype=dtype, device=DEVICE)
    return pool, k.to(DEVICE), slots.to(DEVICE)


def seeded(pool, logical, seed):
    """Two equal summaries whose rows already hold statistics far out (a reset that is not taken
    shows), kmin < kmax in some channels, not in others."""
    gen = torch.Generator().manual_seed(seed)
    a, b = PageSummaries(pool, logical), PageSummaries(pool, logical)
    a.kmax.copy_(3 * torch.randn(a.kmax.shape, generator=gen))
    a.kmin.copy_(3 * torch.randn(a.kmin.shape, generator=gen))
    b.kmax.copy_(a.kmax), b.kmin.copy_(a.kmin)
    return a, b


def heads_index(heads):
    return None if heads is None else torch.tensor(heads, dtype=torch.int64, device=DEVICE)


def reference(s, k, slots, heads):
    """update() over the heads' slots and keys in (sequence, head, token) order."""
    heads = list(range(k.shape[2])) if heads is None else heads
    flat_k = k.transpose(1, 2)[:, heads].reshape(-1, k.shape[-1])
    s.update(0, slots[:, heads].reshape(-1), flat_k)


def assert_bits(a, b):
    """Equal bit for bit, the scratch row (update's sink for resets, no page's) left out."""
    a, b = a[:, :-1].cpu(), b[:, :-1].cpu()
    assert torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("logical, page_size", [(16, 16), (8, 16), (16, 32), (8, 32)])
def test_fold_runs_equals_update(dtype, logical, page_size):
    B, H, D = 2, 3, 24  # D not a power of two: masked channels
    # Heads at a logical page's start, a pool page's start, and inside pages; an empty head.
    before = [0, 5, logical, page_size + 3, 2 * logical - 1, 1]
    for T in (1, 7, logical, 37):
        for heads in (None, [0, 2], [1]):
            pool, k, slots = run_case(B, H, D, T, before, page_size, dtype, seed=T)
            want, got = seeded(pool, logical, T)
            reference(want, k, slots, heads)
            fold_runs(k, slots, got.kmax[0], got.kmin[0], logical, heads_index(heads))
            assert_bits(want.kmax, got.kmax)
            assert_bits(want.kmin, got.kmin)


def test_keys_in_any_layout_and_every_head_subset():
    """k as [B, H, T, D] transposed (the token stride below the head's), heads in any order, none."""
    gen = torch.Generator().manual_seed(3)
    B, H, D, T, logical, page_size = 3, 4, 16, 21, 16, 32
    before = torch.randint(0, 40, (B * H,), generator=gen).tolist()
    pool, k, slots = run_case(B, H, D, T, before, page_size, torch.bfloat16, seed=1)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, D], stride(1) = D
    for heads in (None, [3, 1], [2], []):
        want, got = seeded(pool, logical, 5)
        reference(want, k, slots, heads)
        fold_runs(k, slots, got.kmax[0], got.kmin[0], logical, heads_index(heads))
        assert_bits(want.kmax, got.kmax)
        assert_bits(want.kmin, got.kmin)


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float16])
def test_narrower_keys_into_fp32_statistics(key_dtype):
    """bf16 / fp16 keys into fp32 statistics: converted exactly, as update() converts them."""
    pool, k, slots = run_case(2, 2, 16, 29, [3, 16, 0, 30], 16, torch.float32, seed=2, key_dtype=key_dtype)
    want, got = seeded(pool, 16, 9)
    reference(want, k, slots, None)
    fold_runs(k, slots, got.kmax[0], got.kmin[0], 16)
    assert_bits(want.kmax, got.kmax)
    assert_bits(want.kmin, got.kmin)


def test_nan_keys_make_their_channels_nan():
    """A NaN key's channel is NaN in its page's max and min, as update()'s scatter_reduce makes it;
    the other channels and pages are unchanged."""
    pool, k, slots = run_case(1, 2, 16, 20, [5, 0], 16, torch.bfloat16, seed=4)
    k = k.clone()
    k[0, 3, 0, 2] = k[0, 17, 1, 5] = float("nan")  # head 0 mid-page, head 1 in a page it begins
    want, got = seeded(pool, 16, 10)
    reference(want, k, slots, None)
    fold_runs(k, slots, got.kmax[0], got.kmin[0], 16)
    for a, b in ((want.kmax, got.kmax), (want.kmin, got.kmin)):
        nan = torch.isnan(a)
        assert nan.sum() == 2 and torch.equal(nan, torch.isnan(b))
        assert_bits(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


@pytest.mark.parametrize("kernel", [False, True])
def test_update_runs_equals_update(monkeypatch, kernel):
    """PageSummaries.update_runs on either path: the kernel, or the reference's copies into update()."""
    monkeypatch.setattr(summaries_module, "FORCE", kernel)
    B, H, D, T = 2, 3, 16, 19
    pool, k, slots = run_case(B, H, D, T, [0, 9, 16, 31, 4, 2], 16, torch.float16, seed=3)
    for heads in (None, [0, 2]):
        want, got = seeded(pool, 16, 8)
        reference(want, k, slots, heads)
        got.update_runs(0, slots.reshape(-1), k, heads)  # flat slots, (sequence, head, token) order
        assert_bits(want.kmax, got.kmax)
        assert_bits(want.kmin, got.kmin)
    # fp32 keys into fp16 statistics round: update_runs takes update()'s path for them.
    k = k.float() * (1 + 1e-4 * torch.arange(D, device=k.device))
    want, got = seeded(pool, 16, 8)
    reference(want, k, slots, None)
    got.update_runs(0, slots, k)
    assert_bits(want.kmax, got.kmax)
    assert_bits(want.kmin, got.kmin)
