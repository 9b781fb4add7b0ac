"""Quantized KV: int8 or fp8 (e4m3) codes with one fp32 scale per stored row (one token of one KV head).

Symmetric absmax over head_dim: scale = max|x| / Q with Q = 127 (int8) or 448 (the largest e4m3
value); codes = round(x / scale), clamped to [-Q, Q] (int8 rounds half to even; fp8 rounds to the
nearest e4m3 value). A row dequantizes as codes * scale, computed in fp32 and returned in the compute
dtype. An all-zero row has scale 0 and dequantizes to zeros.

Error per element: int8 at most scale / 2 = max|x| / 254; fp8 at most |x| / 16 (3 mantissa bits,
half an ulp), or scale * 2**-10 for the values e4m3 holds only as subnormals.

The codes sit in the pool where the compute dtype's K/V would (same shape, one byte per element);
the scales sit beside them per slot ([layers, pages, page_size], fp32: 4 bytes per token per head,
as LServe/QServe keep them). The attention kernels read the narrow codes and their scales and
dequantize in registers.
"""

from __future__ import annotations

import torch

from turnkv.attention.reference import dequantize  # noqa: F401  (readers dequantize as attention does)
from turnkv.errors import InvalidRequestError

FP8 = torch.float8_e4m3fn
# Canonical name -> storage dtype; None is the compute dtype itself (no quantization).
KV_DTYPES: dict[str, torch.dtype | None] = {"int8": torch.int8, "fp8": FP8, "none": None}
_ALIASES = {"int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8",
            "none": "none", "full": "none", "auto": "none", "model": "none"}
QMAX = {torch.int8: 127.0, FP8: 448.0}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # per stored row (one token of one KV head), for K and again for V


def kv_dtype_name(kv_dtype) -> str:
    """The canonical name of a KV storage choice: "int8", "fp8" or "none" (the compute dtype).
    Accepts those names and their aliases, a torch dtype, or None. Unknown names raise
    InvalidRequestError listing the choices."""
    if kv_dtype is None:
        return "none"
    if isinstance(kv_dtype, torch.dtype):
        for name, dtype in KV_DTYPES.items():
            if dtype == kv_dtype:
                return name
        raise InvalidRequestError(f"kv_dtype {kv_dtype} is not supported; choose one of: {', '.join(KV_DTYPES)}")
    key = str(kv_dtype).strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise InvalidRequestError(f"unknown kv_dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPES)} "
                                  f"(none keeps K/V in the model's dtype)")
    return _ALIASES[key]


def storage_dtype(kv_dtype) -> torch.dtype | None:
    """The narrow storage dtype of a KV choice (None: the compute dtype)."""
    return KV_DTYPES[kv_dtype_name(kv_dtype)]


def is_quantized(dtype: torch.dtype | None) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> codes [..., D] in `dtype` (int8 or fp8 e4m3) and fp32 scales [...]."""
    q = QMAX[dtype]
    xf = x.float()
    # Times the reciprocal, as written: PyTorch's CUDA division by a scalar multiplies by the
    # reciprocal anyway, so spelling it out gives CPU, CUDA and the fused write the same scales.
    scale = xf.abs().amax(dim=-1) * (1.0 / q)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xf / safe[..., None]).clamp_(-q, q)
    codes = y.round_().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return codes, scale


def round_trip(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x as the store gives it back (quantized then dequantized), in x's dtype; x itself when the
    store keeps the compute dtype."""
    if not is_quantized(dtype):
        return x
    return dequantize(*quantize(x, dtype), x.dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """A view that index_copy_ / index_select accept on every device (fp8 as bytes)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
