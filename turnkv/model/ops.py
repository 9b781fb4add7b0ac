"""The decoder's ops between attention calls, on any device: Triton kernels where they pay, torch ops
everywhere else.

On CUDA: projections over a few rows (decode, tiny prefills) go through the skinny matmul, which
reads the weights near copy bandwidth where cuBLAS does not at M = 1 (q/k/v, o_proj); the residual
add + RMSNorm, RoPE and SiLU * up are one fused kernel each, at any number of tokens. Larger
projections keep cuBLAS. Off CUDA, and whenever autograd records (LServe's gate training), every op
is the torch code the decoder always ran, bit for bit.

Switches: TURNKV_FUSED=0 in the environment (read at import) or `ops.ENABLED = False` turns the
kernels off; `ops.FORCE = True` runs them off CUDA too (Triton's interpreter on CPU), for tests.
Both are read at every call, so a CUDA graph captures whichever path was on when it was captured.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

ENABLED = os.environ.get("TURNKV_FUSED", "1") != "0"
FORCE = False
# Rows (tokens x batch) up to which a projection takes the skinny matmul. Its cost is one pass over
# the weights until the rows' multiply-adds catch up with it, which they do not by 8 on tensor cores;
# beyond the decode batch buckets 1-8, cuBLAS's tiles are full enough. benchmarks/kernels/gpu_step_kernels.py
# times M = 1..16 against cuBLAS to move it.
SKINNY_MAX_ROWS = 8


@functools.cache
def _kernels():
    try:
        from turnkv.model.triton import activation, gemv, norm, rope
    except ImportError:  # no Triton: the torch ops everywhere
        return None
    return {"gemv": gemv, "norm": norm, "rope": rope, "activation": activation}


def use_kernels(t: torch.Tensor) -> bool:
    if not ENABLED or torch.is_grad_enabled():
        return False
    return (t.device.type == "cuda" or FORCE) and _kernels() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; over at most SKINNY_MAX_ROWS rows on CUDA, the skinny matmul."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if 0 < rows <= SKINNY_MAX_ROWS and use_kernels(x) and weight.is_contiguous() and x.dtype == weight.dtype:
        flat = x.reshape(rows, K)  # a view for the decoder's inputs, down_proj's strided gate half too
        if flat.stride(1) == 1:
            return _kernels()["gemv"].skinny_matmul(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel, which accumulates in fp32 for half-precision inputs. transformers rounds
    # to the model dtype before scaling by the weight; the difference is one rounding, and doing
    # it its way takes four passes over the activations instead of one.
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight."""
    H = x.shape[-1]
    if use_kernels(x) and x.shape == residual.shape and x.dtype == residual.dtype and x.is_contiguous() \
            and residual.is_contiguous():
        out = _kernels()["norm"].add_rms_norm(x.view(-1, H), residual.view(-1, H), weight, eps)
        return out.view(x.shape)
    return rms_norm(residual.add_(x), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE into a new tensor. x: [B, T, H, D]; cos/sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return rotated.mul_(sin).addcmul_(x, cos)


def rotate_heads(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on heads [0, num_heads) of qkv [B, T, H, D] -> [B, T, num_heads, D]: rotated in place by
    the kernel, or a rotated copy by the torch path (whose qkv is left as it was)."""
    if use_kernels(qkv) and qkv.stride(3) == 1 and cos.stride(3) == 1 and cos.stride() == sin.stride() \
            and cos.shape[0] in (1, qkv.shape[0]) and cos.shape[1] == qkv.shape[1] and cos.dtype == qkv.dtype:
        return _kernels()["rope"].rope_in_place(qkv, num_heads, cos, sin)
    return apply_rope(qkv[:, :, :num_heads], cos, sin)


def rotate_and_store(qkv: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     q_out: torch.Tensor, slots: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor) -> bool:
    """A decode step's RoPE with its stores in one kernel (triton/rope.py rope_store): the q and k heads
    of qkv [B, 1, Hq + 2 Hkv, D] rotated in place, q copied into q_out [B, Hq, D], k and v written at
    slots [B * Hkv] of k_store / v_store (unquantized pages of the model dtype). False, with nothing
    done, where the kernel does not apply: the caller then rotates and stores by itself."""
    if not (use_kernels(qkv) and qkv.shape[1] == 1 and qkv.stride(3) == 1 and cos.stride(3) == 1
            and cos.stride() == sin.stride() and cos.shape[0] in (1, qkv.shape[0]) and cos.dtype == qkv.dtype
            and q_out.dtype == k_store.dtype == v_store.dtype == qkv.dtype and k_store.is_contiguous()
            and v_store.is_contiguous() and slots.is_contiguous()):
        return False
    _kernels()["rope"].rope_store(qkv, num_q_heads, cos, sin, q_out, slots, k_store, v_store)
    return True


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """gate_up [..., 2 I] -> silu(gate) * up [..., I], written over the gate half (no new buffer)."""
    if use_kernels(gate_up) and gate_up.is_contiguous():
        flat = gate_up.view(-1, 2 * intermediate)
        out = _kernels()["activation"].silu_mul_in_place(flat, intermediate)
        return out.view(*gate_up.shape[:-1], intermediate)
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
