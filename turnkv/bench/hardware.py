"""The hardware floor, measured in the same run as the figures it bounds: copy bandwidth and matmul rate."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeat: int = 5, warmup: int = 1,
                after: Callable[[], object] | None = None) -> float:
    """Median wall seconds of fn(), with the device synchronised before every clock read. after(), if
    given, runs after every call of fn, outside the clock (an undo that puts the state back)."""
    times = []
    for i in range(warmup + repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device, repeat=10, warmup=2)
    return 2 * n / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype` (the model's)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_time(lambda: a @ b, device, repeat=10, warmup=2)
    return 2 * n**3 / seconds


def prefill_flops(config, new_tokens: int, history: int = 0) -> float:
    """Matmul FLOPs to prefill `new_tokens` after `history` kept tokens: the linear layers for every
    new token, the LM head for the last one, and causal attention (QK^T and PV) over what each sees."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token_layer = 2 * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    linear = c.num_layers * per_token_layer * new_tokens + 2 * c.hidden_size * c.vocab_size
    seen = new_tokens * history + new_tokens * (new_tokens + 1) / 2  # keys summed over the new queries
    attention = c.num_layers * 4 * c.num_heads * c.head_dim * seen
    return linear + attention


def prefill_floor(config, hw: dict, kv_token_bytes: float, new_tokens: int, history: int = 0) -> float:
    """Seconds a prefill of `new_tokens` after `history` kept tokens cannot beat: its matmul FLOPs at the
    matmul rate, or reading every weight once and the KV it attends to (kv_token_bytes per token, every
    layer and KV head) at the copy bandwidth, whichever is longer. A short turn is bound by the reads."""
    compute = prefill_flops(config, new_tokens, history) / hw["matmul_rate"]
    reads = (hw["weight_bytes"] + (history + new_tokens) * kv_token_bytes) / hw["copy_bandwidth"]
    return max(compute, reads)


def decode_bytes(weight_bytes: int, kv_bytes: int) -> int:
    """Bytes one decode step must read: every weight once, and the KV it attends to."""
    return weight_bytes + kv_bytes
