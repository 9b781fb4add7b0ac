"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a handful of rows M (1..8).

Each program owns BLOCK_N output features and streams their rows of W once for all M rows, so W is read
exactly once per call. A tile multiplies by CUDA-core FMAs (dot=False) or swapped-operand tensor-core
dots (dot=True); split_k > 1 reduces in the same launch through an arrival counter that the last
program resets, so a launch needs no second kernel or memset inside a CUDA graph.
Design: docs/kernels.md#skinny-matmul-for-decode"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.gpu import num_sms
from turnkv.model.triton import pdl

# Arrival counters for split-K: one per output tile, zero between launches (the last program of a
# tile resets its own). Launches on one stream run one after the other, so one set per device serves
# every call; a split-K launch with more tiles than this falls back to one split.
MAX_SPLIT_TILES = 1 << 16


@triton.jit
def _skinny_matmul(
    x_ptr, w_ptr, bias_ptr, y_ptr, partial_ptr, arrivals_ptr,
    M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    pdl.enter(GDC, False)  # PDL: wait for the previous kernel (model/triton/pdl.py)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    # Features past N re-read row N-1 instead of masking it: the loads of W stay unmasked.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * per_split
    k_end = tl.minimum(k_start + per_split, K)

    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc += tl.dot(w, tl.trans(x.to(w.dtype)), input_precision=PRECISION)
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], 2)
    if not DOT and BLOCK_M == 1:
        out = tl.sum(acc, 1)[:, None]
    else:
        out = acc

    # out[n, m] is y[m, n].
    mask = n_ok[:, None] & m_ok[None, :]
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials [SPLIT_K, M, N] in fp32. The barrier puts every thread's store before the release
        # of the arrival count, so the last program's loads (from L2: .cg) see all of them.
        tl.store(partial_ptr + (split * M + m[None, :]) * N + n[:, None], out, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(partial_ptr + (s * M + m[None, :]) * N + n[:, None], mask=mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrivals_ptr + tile, 0)


# Launch settings from a sweep on an H100 (benchmarks/kernels/gpu_step_kernels.py --sweep --sweep-rows 1).
# At M = 1 the FMA path with 4 features x 2048 of K per program is the fastest on every Llama-3.1-8B
# projection: plain loads of 16 KB per program and thousands of programs keep enough bytes in flight.
# Tensor cores with the operands swapped serve several rows: W's tile is the MMA's large side, the
# rows of x (padded to 16) its small one, its loads pipelined through shared memory (cp.async).
M1_CONFIG = dict(block_n=4, block_k=2048, num_warps=4, num_stages=1, split_k=1, dot=False)
MULTI_ROW_CONFIG = dict(block_n=16, block_k=256, num_warps=4, num_stages=4, split_k=1, dot=True)
FMA_CONFIG = dict(block_n=8, block_k=512, num_warps=4, num_stages=1, split_k=1, dot=False)
# Per-shape settings measured on a GPU, (rows, N, K) -> config with rows = M rounded up to a power of
# two; benchmarks/kernels/gpu_step_kernels.py --sweep prints entries in this form. Empty: at M = 1 the
# sweep's best per shape is M1_CONFIG for every shape.
TUNED: dict[tuple[int, int, int], dict] = {}


def default_config(M: int, N: int, K: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch settings for one call; the one place where they depend on the device.

    On CUDA: TUNED's entry for the shape if there is one, else M1_CONFIG at M = 1 and MULTI_ROW_CONFIG
    above, with split-K when the tiles alone cannot give every SM of `device` one (the SM count is
    the device's). Elsewhere (Triton's interpreter, for the CPU tests): no TUNED entry and no split-K,
    and FMA_CONFIG for bf16, since the interpreter computes bf16 dots wrongly; the CPU tests therefore
    check the bf16 FMA path, not the dot path an H100 runs for 2..8 rows."""
    tuned = TUNED.get((triton.next_power_of_2(M), N, K)) if device.type == "cuda" else None
    if tuned is not None:
        return dict(tuned)
    config = dict(M1_CONFIG if M == 1 else MULTI_ROW_CONFIG)
    if device.type != "cuda" and dtype == torch.bfloat16:
        config = dict(FMA_CONFIG)  # Triton's interpreter (tests on CPU) computes bf16 dots wrongly
    if device.type == "cuda":
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
        tiles = triton.cdiv(N, config["block_n"])
        if tiles < sms:
            config["split_k"] = max(1, min(triton.cdiv(2 * sms, tiles), K // (4 * config["block_k"])))
    return config


_arrivals: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The split-K counters of `device`, made on first use outside a CUDA-graph capture (a capture
    would put them in the graph's private pool and replay the zeroing): None while capturing."""
    counters = _arrivals.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _arrivals[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided, columns contiguous), weight [N, K] contiguous, bias [N] or None
    -> y [M, N] in x's dtype (into `out` when given). config overrides default_config's settings
    (block_n, block_k, num_warps, num_stages, split_k, dot), for tuning."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous())
    launch = {**default_config(M, N, K, x.device, x.dtype), **(config or {})}
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (M, N) and out.stride(1) == 1
    block_n, block_k, split_k, dot = launch["block_n"], launch["block_k"], launch["split_k"], launch["dot"]
    tiles = triton.cdiv(N, block_n)
    arrivals = _arrival_counters(x.device) if split_k > 1 and tiles <= MAX_SPLIT_TILES else None
    if arrivals is None:
        split_k = 1
    partial = torch.empty(split_k * M * N, dtype=torch.float32, device=x.device) if split_k > 1 else out
    block_m = max(16, triton.next_power_of_2(M)) if dot else triton.next_power_of_2(M)
    _skinny_matmul[(tiles, split_k)](
        x, weight, bias if bias is not None else weight, out, partial, arrivals if arrivals is not None else out,
        M, N, K, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, DOT=dot,
        HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0,
        # fp32 stays fp32: tensor cores would round it to TF32.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl.launch_options(x.device),
    )
    return out
