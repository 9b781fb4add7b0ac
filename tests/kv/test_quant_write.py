"""The one-launch quantized KV write (turnkv/kv/quant_write.py) against the torch path of
PagePool.write: the same codes and scales, bit for bit, at the same slots and nowhere else. On CPU the
kernel runs in Triton's interpreter (ops.FORCE)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from turnkv.kv import quant  # noqa: E402
from turnkv.kv.pool import PagePool  # noqa: E402
from turnkv.model import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes in numpy, which has no bfloat16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rows(n, D, dtype, seed):
    """Random rows of magnitudes 1e-3..1e2, and, from 3 rows on, the cases that decide rounding: an
    all-zero row, a row whose int8 codes fall exactly on ties (x / scale = k + 0.5), a lone outlier
    over values that become fp8 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen) * torch.logspace(-3, 2, n)[:, None]
    if n >= 3:
        x[0] = 0.0
        ties = torch.arange(D - 1) % 120 + 0.5  # scale = 127 * 0.25 / 127 = 0.25 exactly
        x[1] = torch.cat([torch.tensor([127.0]), ties * (-1) ** torch.arange(D - 1)]) * 0.25
        x[2] = torch.linspace(-3e-3, 3e-3, D)  # beside the outlier: fp8 subnormals (|x / scale| < 2**-6)
        x[2, 3] = 50.0
    return x.to(DEVICE, dtype)


def write_both(kv, dtype, k, v, slots, monkeypatch):
    """The same write through the torch path and through the kernel (checked to have run)."""
    from turnkv.kv import quant_write

    calls = []
    real = quant_write.quantize_write
    monkeypatch.setattr(quant_write, "quantize_write", lambda *a: calls.append(1) or real(*a))
    pools = {}
    for fused in (False, True):
        monkeypatch.setattr(ops, "FORCE", fused)
        monkeypatch.setattr(ops, "ENABLED", fused)
        pool = PagePool(2, 1, k.shape[1], 6, 4, dtype=dtype, device=DEVICE, kv_dtype=kv)
        with torch.no_grad():  # the kernels run only where autograd does not record, as in the engine
            pool.write(1, slots, k, v)
        pools[fused] = pool
        assert len(calls) == int(fused)
    return pools[False], pools[True]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_write_equals_torch_path(kv, dtype, monkeypatch):
    D = 48  # not a power of two: masked columns
    k, v = rows(9, D, dtype, 0), rows(9, D, dtype, 1).flip(0)
    slots = torch.tensor([5, 0, 23, 7, 8, 12, 1, 19, 4], device=DEVICE)
    torch_pool, fused_pool = write_both(kv, dtype, k, v, slots, monkeypatch)
    for a, b in ((torch_pool.k, fused_pool.k), (torch_pool.v, fused_pool.v)):
        assert torch.equal(quant.raw(a), quant.raw(b)), "codes differ"
    assert torch.equal(torch_pool.k_scale, fused_pool.k_scale) and torch.equal(torch_pool.v_scale, fused_pool.v_scale)
    # Written where asked, in layer 1 only, and read back as the rows within quantization error.
    written = torch.zeros(6 * 4, dtype=torch.bool)
    written[slots.cpu()] = True
    assert (fused_pool.k_scale[1].view(-1).cpu() > 0)[written].sum() == len(slots) - 1  # the zero row has scale 0
    assert not fused_pool.k_scale[0].any() and not quant.raw(fused_pool.k[0]).any()
    assert not fused_pool.k_scale[1].view(-1).cpu()[~written].any()
    back = fused_pool.k[1].view(-1, D)[slots].float() * fused_pool.k_scale[1].view(-1)[slots][:, None]
    err = (back - k.float()).abs().amax(dim=1)
    # Half a step for int8 (plus the float rounding of code * scale itself), 1/16 of 448 steps for e4m3.
    bound = fused_pool.k_scale[1].view(-1)[slots] * (0.5 if kv == "int8" else 32) * (1 + 1e-5)
    assert (err <= bound).all()


def test_strided_rows(monkeypatch):
    """Rows that are a view of a wider tensor (the fused qkv output's k part) are read in place."""
    wide = rows(5, 96, torch.float32, 2)
    k, v = wide[:, :32], wide[:, 64:]
    assert k.stride(0) == 96
    slots = torch.tensor([3, 2, 1, 0, 9], device=DEVICE)
    torch_pool, fused_pool = write_both("int8", torch.float32, k, v, slots, monkeypatch)
    assert torch.equal(torch_pool.k, fused_pool.k) and torch.equal(torch_pool.v, fused_pool.v)
    assert torch.equal(torch_pool.v_scale, fused_pool.v_scale)


def test_kernels_off_keeps_the_torch_path(monkeypatch):
    from turnkv.kv import quant_write

    calls = []
    monkeypatch.setattr(quant_write, "quantize_write", lambda *a: calls.append(a))
    monkeypatch.setattr(ops, "FORCE", True)
    monkeypatch.setattr(ops, "ENABLED", False)
    pool = PagePool(1, 1, 16, 2, 4, device=DEVICE, kv_dtype="int8")
    with torch.no_grad():
        pool.write(0, torch.tensor([1], device=DEVICE), rows(1, 16, torch.float32, 3),
                   rows(1, 16, torch.float32, 4))
    assert not calls and pool.k_scale.any()
