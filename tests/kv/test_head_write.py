"""The one-launch K/V write from the decoder's head layout (turnkv/kv/head_write.py) against the
torch path of PagePool.write_heads (reorder, then index_copy_): the same pool, bit for bit, at the
same slots and nowhere else. On CPU the kernel runs in Triton's interpreter (ops.FORCE)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from turnkv.kv.pool import PagePool  # noqa: E402  (tests/conftest.py sets TRITON_INTERPRET without CUDA)
from turnkv.model import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def decoder_views(B, T, Hq, H, D, dtype, seed):
    """k and v as the decoder passes them: [B, T, H, D] slices of one fused qkv tensor (strided)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, Hq + 2 * H, D, generator=gen).to(DEVICE, dtype)
    return qkv[:, :, Hq : Hq + H], qkv[:, :, Hq + H :]


def write_both(k, v, slots, dtype, kv_dtype, monkeypatch):
    from turnkv.kv import head_write

    calls = []
    real = head_write.write_heads
    monkeypatch.setattr(head_write, "write_heads", lambda *a: calls.append(1) or real(*a))
    pools = []
    for fused in (False, True):
        monkeypatch.setattr(ops, "FORCE", fused)
        monkeypatch.setattr(ops, "ENABLED", fused)
        pool = PagePool(2, k.shape[2], k.shape[3], 64, 4, dtype=dtype, device=DEVICE, kv_dtype=kv_dtype)
        with torch.no_grad():  # the kernels run only where autograd does not record, as in the engine
            pool.write_heads(1, slots, k, v)
        pools.append(pool)
    return pools, len(calls)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,D", [(2, 37, 24), (3, 1, 16), (1, 70, 32)])  # masked tokens / columns, decode
def test_fused_write_equals_torch_path(B, T, D, dtype, monkeypatch):
    H = 2
    k, v = decoder_views(B, T, 4, H, D, dtype, seed=T)
    assert not k.is_contiguous()
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(64 * 4, generator=gen)[: B * H * T].to(DEVICE)
    (torch_pool, fused_pool), calls = write_both(k, v, slots, dtype, None, monkeypatch)
    assert calls == 1
    assert torch.equal(torch_pool.k, fused_pool.k) and torch.equal(torch_pool.v, fused_pool.v)
    # Row i of the slots is (sequence, head, token) = divmod order; layer 0 untouched.
    expect_k = k.transpose(1, 2).reshape(-1, D)
    assert torch.equal(fused_pool.k[1].view(-1, D)[slots], expect_k)
    assert torch.equal(fused_pool.v[1].view(-1, D)[slots], v.transpose(1, 2).reshape(-1, D))
    assert not fused_pool.k[0].any() and not fused_pool.v[0].any()
    untouched = torch.ones(64 * 4, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not fused_pool.k[1].view(-1, D)[untouched].any()


def test_quantized_pool_keeps_its_own_write(monkeypatch):
    """A quantized pool quantizes (quant_write), so the head-layout kernel is not used there."""
    k, v = decoder_views(1, 5, 2, 2, 16, torch.float32, seed=3)
    slots = torch.arange(10, device=DEVICE)
    (torch_pool, fused_pool), calls = write_both(k, v, slots, torch.float32, "int8", monkeypatch)
    assert calls == 0
    assert torch.equal(torch_pool.k, fused_pool.k) and torch.equal(torch_pool.k_scale, fused_pool.k_scale)
