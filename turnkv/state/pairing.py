"""Which layers share their stored KV: Krul's Algorithm 1, and the fixed pairs of its baselines."""

from __future__ import annotations

import torch


def select_pairs(ir_score: torch.Tensor, distance: torch.Tensor, ir_threshold: float, layer_ratio: float) -> list[tuple[int, int]]:
    """Greedy disjoint pairs (i, j), i > j, among the I-R layers (ir_score >= ir_threshold), closest
    attention maps first, until the paired layers reach N * layer_ratio (the paper's code's reading of
    r_l). Ties go to the closer layers, then the shallower. May stop short when I-R layers run out."""
    N = len(ir_score)
    ir_layers = [layer for layer in range(N) if float(ir_score[layer]) >= ir_threshold]
    candidates = sorted(((float(distance[i, j]), i - j, j, i) for i in ir_layers for j in ir_layers if i > j))
    used, pairs = set(), []
    target = N * layer_ratio
    for _, _, j, i in candidates:
        if len(used) >= target:
            break
        if i in used or j in used:
            continue
        used |= {i, j}
        pairs.append((i, j))
    return pairs


def adjacent_pairs(first: int, last: int, layer_ratio: float, num_layers: int) -> list[tuple[int, int]]:
    """Adjacent pairs (first+1, first), (first+3, first+2), ... inside [first, last], at most
    N * layer_ratio layers in all."""
    pairs = []
    for j in range(first, last, 2):
        if 2 * (len(pairs) + 1) > num_layers * layer_ratio + 1e-9:
            break
        pairs.append((j + 1, j))
    return pairs


def minicache_pairs(num_layers: int, layer_ratio: float = 0.5) -> list[tuple[int, int]]:
    """MiniCache: adjacent pairs in the latter half (16-31 of 32 layers)."""
    return adjacent_pairs(num_layers // 2, num_layers - 1, layer_ratio, num_layers)


def krul_fix_pairs(num_layers: int, layer_ratio: float = 0.5) -> list[tuple[int, int]]:
    """Krul (Fix): adjacent pairs in layers 9-24 of a 32-layer model, scaled to the model's depth."""
    first = round(9 * num_layers / 32)
    last = min(num_layers - 1, first + round(16 * num_layers / 32) - 1)
    return adjacent_pairs(first, last, layer_ratio, num_layers)
