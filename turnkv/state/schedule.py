"""Krul's bubble-free restoration scheduler: the calibrated recompute/load split r_c and the
per-layer recompute lengths (the "pyramid").

Costs are modelled and calibrated on the machine: recomputing R[l] tokens at layer l
costs a * R[l] + b * R[l]^2 (dense layers, then attention), and loading costs bytes / bandwidth of
the tier. r_c is the uniform split minimising max(T_C, T_L) (= min |T_C - T_L| where they cross).
The pyramid keeps R non-increasing with depth (the hidden states layer l needs exist only for
tokens layer l-1 recomputed) and searches a linear ramp R[l] = R0 + k ((N-1)/2 - l), cut to
[0, n] and made non-increasing, for the least max(T_C, T_L) whose stored bytes stay within Krul's
budget C = c (1 - r_c) N ("budget" mode). Shared layers free load time and budget,
which the ramp hands to deeper layers; "min_storage" keeps the uniform split and banks the savings.
A `storage` share replaces the budget by that share of the full KV: the ramp then recomputes what it
must to fit (tokens recomputed are not stored), fastest first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention import reference
from turnkv.state.prefix import recompute_prefix


@dataclass
class CostModel:
    per_token_layer_s: float  # a: recompute seconds per token per layer
    per_token2_layer_s: float  # b: attention's quadratic term, per token^2 per layer
    bytes_per_s: float  # load bandwidth of the tier the state comes back from

    def compute_s(self, starts: np.ndarray) -> np.ndarray:
        """starts [..., N] -> recompute seconds [...]."""
        s = np.asarray(starts, dtype=np.float64)
        return (self.per_token_layer_s * s + self.per_token2_layer_s * s * s).sum(-1)

    def load_s(self, nbytes) -> np.ndarray:
        return np.asarray(nbytes, dtype=np.float64) / self.bytes_per_s


def layer_token_bytes(num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V bytes of one token in one layer."""
    return 2 * num_kv_heads * head_dim * element_size


def full_bytes(n: int, num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V bytes of a whole history of n tokens (what `load` stores)."""
    return n * num_layers * layer_token_bytes(num_kv_heads, head_dim, element_size)


def stored_bytes(starts: np.ndarray, n: int, pairs, num_kv_heads: int, head_dim: int, element_size: int,
                 max_retained: float = 0.0) -> np.ndarray:
    """Bytes the split form stores for starts [..., N] (pack_split's tensors, to the byte): unpaired
    layers their loaded rows (K and V); a pair one direction for K and one for V over the deeper
    layer's loaded rows, four fp32 magnitudes per row (K and V of both layers), and per kind up to
    int(max_retained * rows) retained rows: an int32 index and both layers' originals. Exact when
    the retention cap binds (MiniCache's threshold alone retains more; merge.py), else an upper bound."""
    starts = np.asarray(starts, dtype=np.int64)
    row = head_dim * element_size  # one K (or V) row of one (token, head)
    loaded = (n - starts) * num_kv_heads  # rows per layer
    paired = {layer for pair in pairs for layer in pair}
    unpaired = [layer for layer in range(starts.shape[-1]) if layer not in paired]
    total = loaded[..., unpaired].sum(-1) * 2 * row
    for i, _ in pairs:
        rows = loaded[..., i]
        retained = np.floor(max_retained * rows)  # merge_rows' cap, int(max_retained * rows)
        total = total + rows * (2 * row + 4 * 4) + 2 * retained * (4 + 2 * row)
    return total


def pyramid(n: int, num_layers: int, pairs, cost: CostModel, recompute_ratio: float, num_kv_heads: int,
            head_dim: int, element_size: int, mode: str = "budget", grid: int = 41,
            retained_share: float = 0.0, storage: float | None = None) -> list[int]:
    """Per-layer recompute lengths R[l] (non-increasing) for a history of n tokens: the fastest
    linear ramp (max(T_C, T_L)) whose stored bytes fit the budget. The budget is Krul's
    C = c (1 - r_c) N, or, with `storage`, that share of the full KV (the user's storage knob:
    storage=0.5 stores at most half of what `load` would)."""
    N = num_layers
    r0 = int(round(recompute_ratio * n))
    if mode == "min_storage" and storage is None or n == 0:
        return [r0] * N
    if mode not in ("budget", "min_storage"):
        raise ValueError(f"allocation mode is budget or min_storage, not {mode!r}")
    full = full_bytes(n, N, num_kv_heads, head_dim, element_size)
    budget = storage * full if storage is not None else N * (n - r0) * layer_token_bytes(num_kv_heads, head_dim, element_size)
    starts = ramps(n, N, r0, grid)
    store = stored_bytes(starts, n, pairs, num_kv_heads, head_dim, element_size, retained_share)
    t = np.maximum(cost.compute_s(starts), cost.load_s(store))
    t = np.where(store <= budget, t, np.inf)
    best = np.lexsort((store, t))[0]  # fastest, then the least storage
    if not np.isfinite(t[best]):
        return [n] * N if storage is not None else [r0] * N  # recompute everything: stores nothing
    return [int(s) for s in starts[best]]


def ramps(n: int, num_layers: int, r0: int, grid: int = 41) -> np.ndarray:
    """The recompute lengths [candidates, N] pyramid() chooses from (each non-increasing with depth):
    bases every 0.5% of the history and r0, slopes up to 2n/N per layer, cut to [0, n]."""
    N = num_layers
    centre = (N - 1) / 2 - np.arange(N)
    bases = np.unique(np.append(np.linspace(0, n, 201), r0))
    slopes = np.linspace(0, 2 * n / max(1, N), grid)
    lengths = bases[:, None, None] + slopes[None, :, None] * centre  # [bases, slopes, N]
    return np.minimum.accumulate(np.clip(np.round(lengths), 0, n), axis=-1).reshape(-1, N)


def max_pairs(num_layers: int, layer_ratio: float) -> int:
    """The most pairs pairing.select_pairs returns (when every layer is I-R): pairs until
    N * layer_ratio layers are paired, or fewer than two are left."""
    paired = 0
    while paired < num_layers * layer_ratio and paired + 2 <= num_layers:
        paired += 2
    return paired // 2


def stored_bytes_floor(starts: np.ndarray, n: int, num_pairs: int, num_kv_heads: int, head_dim: int,
                       element_size: int, max_retained: float = 0.0) -> np.ndarray:
    """A lower bound of stored_bytes(starts, n, pairs, ...) over every set of at most `num_pairs`
    disjoint pairs, for starts [..., N] non-increasing with depth (so the loaded rows L[l] are
    non-decreasing). A pair (i, j), i > j, saves 2 row L[j] - 16 L[i] - 2 floor(max_retained L[i])
    (4 + 2 row) against two unpaired layers, which is at most max(0, a) L[j] + b with
    a = 2 row - 16 - 2 max_retained (4 + 2 row) and b = 2 (4 + 2 row) (L[i] >= L[j], floor(x) > x - 1);
    and the m-th deepest of the shallower layers j of disjoint pairs is at most layer N - 2m."""
    starts = np.asarray(starts, dtype=np.int64)
    N = starts.shape[-1]
    row = head_dim * element_size
    loaded = (n - starts) * num_kv_heads  # rows per layer
    a, b = max(0.0, 2 * row - 16 - 2 * max_retained * (4 + 2 * row)), 2 * (4 + 2 * row)
    deepest = N - 2 * np.arange(1, min(num_pairs, N // 2) + 1)
    saved = (a * loaded[..., deepest] + b).sum(-1)
    return np.maximum(loaded.sum(-1) * 2 * row - saved, 0)


def best_case_s(n: int, num_layers: int, num_pairs: int, cost: CostModel, recompute_ratio: float,
                num_kv_heads: int, head_dim: int, element_size: int, max_retained: float = 0.0,
                grid: int = 41) -> float:
    """A lower bound of max(T_C, T_L) of the plan pyramid() picks for a history of n tokens, whatever
    pairs (at most `num_pairs`) it is given: the least, over every recompute length it may return
    (ramps(), uniform r_c, everything recomputed; the budget disregarded), of max(T_C, T_L) with the
    stored bytes at their floor (stored_bytes_floor)."""
    N = num_layers
    r0 = int(round(recompute_ratio * n))
    starts = np.concatenate([ramps(n, N, r0, grid), np.full((1, N), r0), np.full((1, N), n)])
    floor = stored_bytes_floor(starts, n, num_pairs, num_kv_heads, head_dim, element_size, max_retained)
    return float(np.maximum(cost.compute_s(starts), cost.load_s(floor)).min())


def best_ratio(n: int, num_layers: int, cost: CostModel, num_kv_heads: int, head_dim: int, element_size: int) -> float:
    """The uniform split r_c minimising max(T_C, T_L) for a history of n tokens (Eq. 1)."""
    ratios = np.linspace(0, 1, 101)
    starts = np.repeat(np.round(ratios * n)[:, None], num_layers, axis=1)
    load = cost.load_s((n - starts[:, 0]) * num_layers * layer_token_bytes(num_kv_heads, head_dim, element_size))
    return float(ratios[np.argmin(np.maximum(cost.compute_s(starts), load))])


# ---- calibration on this machine --------------------------------------------------------------
def _timed(fn, device, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_bandwidth(device: torch.device, nbytes: int = 64 << 20, pinned: bool | None = None) -> float:
    """Host -> device copy bandwidth (bytes/s); on a CPU device, a host memcpy into the pool."""
    pinned = device.type == "cuda" if pinned is None else pinned
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=pinned), device)


def measure_compute(model, device: torch.device, lengths=(512, 2048)) -> tuple[float, float]:
    """(a, b) of the recompute cost, fitted on prefix recomputes of two lengths over every layer.
    Lengths of 512 and 2048: the prefixes Krul recomputes are thousands of tokens (a 256-token GEMM
    runs far below peak and made the linear term too large)."""
    class Discard:
        def attention(self, layer, q, k, v):
            return reference.causal_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    N = len(model.layers)
    top = model.config.max_position_embeddings
    lengths = [min(x, top) for x in lengths]
    if lengths[0] >= lengths[1]:  # a model with few positions: two lengths it has
        lengths = [max(1, top // 4), top]
    times = [_timed(lambda n=n: recompute_prefix(model, [0] * n, [n] * N, Discard()), device) for n in lengths]
    (n1, n2), (t1, t2) = lengths, times
    # t = N (a n + b n^2): solve the 2x2 system, keeping both terms non-negative.
    b = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1)) / N
    a = max(1e-12, (t1 / n1) / N - b * n1)
    return a, b
