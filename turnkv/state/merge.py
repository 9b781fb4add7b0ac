"""MiniCache's cross-layer merge of one layer pair's K (or V) rows, as Krul stores its shared layers.

Each row x (one token of one KV head) splits into magnitude and direction. The pair keeps one
direction per row, the SLERP of the two unit vectors, the magnitude of each layer's row, and, for the
rows whose two directions are too far apart to share, both originals. Restoring layer l is then
direction * |x_l|, with the retained rows written back.

Retention follows MiniCache: with angular distance d = Omega / pi between the two rows, rows with
d > d_min + (d_max - d_min) * retain_threshold keep their originals. Krul's own `gamma` (the I-R
threshold) is a different thing; the two are named apart on purpose.

That rule alone keeps almost every row when the two layers' rows are far apart everywhere (as
adjacent layers' keys are on SmolLM2-135M, and on random weights), and a "merged" pair then stores
more than two plain layers. `max_retained` therefore caps the retained share, keeping the farthest rows:
outliers stay few, and storage stays what the method promises. max_retained=1 is the literal rule.
"""

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
