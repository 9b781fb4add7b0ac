"""MiniCache's cross-layer merge of one layer pair's K (or V) rows, as Krul stores its shared layers.

Each row (one token of one KV head) keeps one direction shared by the pair (the SLERP of the two unit
vectors) and each layer's magnitude; restoring layer l is direction * |x_l|. Rows whose angular
distance d = Omega / pi exceeds d_min + (d_max - d_min) * retain_threshold keep both originals
(MiniCache's rule, not Krul's gamma), capped at the farthest `max_retained` share of the rows
(max_retained=1 is the literal rule). Design: docs/methods/krul.md#merged-pairs-and-retention"""

from __future__ import annotations

import torch

NEAR_PARALLEL = 1e-4  # sin(Omega) below this: SLERP's weights are 0/0, use the linear limit


def merge_rows(xi: torch.Tensor, xj: torch.Tensor, tau: float = 0.6, retain_threshold: float = 0.05,
               max_retained: float = 0.05) -> dict:
    """xi, xj [n, D] rows of the deeper layer i and the shallower layer j at the same tokens.
    Returns direction [n, D] (input dtype), magnitudes mag_i, mag_j [n] fp32, the retained row
    indices [r] (int32) and the retained rows of each layer [r, D]."""
    a, b = xi.float(), xj.float()
    mag_i, mag_j = a.norm(dim=-1), b.norm(dim=-1)
    ui = a / mag_i.clamp_min(1e-12)[:, None]
    uj = b / mag_j.clamp_min(1e-12)[:, None]
    omega = (ui * uj).sum(-1).clamp(-1.0, 1.0).acos()
    sin = omega.sin()
    parallel = sin < NEAR_PARALLEL
    safe = torch.where(parallel, torch.ones_like(sin), sin)
    wj = torch.where(parallel, torch.full_like(sin, 1 - tau), ((1 - tau) * omega).sin() / safe)
    wi = torch.where(parallel, torch.full_like(sin, tau), (tau * omega).sin() / safe)
    direction = wj[:, None] * uj + wi[:, None] * ui
    # SLERP of unit vectors is a unit vector; renormalising only matters on the linear fallback.
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    distance = omega / torch.pi
    if distance.numel():
        lo, hi = distance.min(), distance.max()
        retained = torch.nonzero(distance > lo + (hi - lo) * retain_threshold).flatten()
        cap = int(max_retained * distance.numel())
        if retained.numel() > cap:
            retained = retained[distance[retained].topk(cap).indices].sort().values
    else:
        retained = torch.zeros(0, dtype=torch.int64, device=xi.device)
    return {"dir": direction.to(xi.dtype), "mag_i": mag_i, "mag_j": mag_j, "idx": retained.to(torch.int32),
            "ret_i": xi[retained], "ret_j": xj[retained]}


def restore_rows(direction: torch.Tensor, magnitude: torch.Tensor, idx: torch.Tensor, retained: torch.Tensor) -> torch.Tensor:
    """One layer's rows back from the merged form: direction * magnitude, originals at idx."""
    rows = (direction.float() * magnitude.float()[:, None]).to(direction.dtype)
    if idx.numel():
        rows[idx.long()] = retained.to(rows.dtype)
    return rows
