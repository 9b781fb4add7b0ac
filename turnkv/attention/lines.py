"""Vertical and slash lines of a prefill attention matrix, shared by LoopServe, MInference-style
vertical-slash and the A-shape/Tri-shape baselines.

A prefill chunk's rows are new tokens at absolute positions q_pos; its columns are the kept keys of a
head, entries 0..S-1 of the head's list, at absolute positions k_pos (after eviction positions have
holes, so everything is defined on positions, never on entry indices):
- a vertical line is one key entry c: the cells (p, c) for every row p >= k_pos[c];
- a slash line is a diagonal offset delta >= 0: the cells (p, c) with p - k_pos[c] == delta.
Offsets are absolute, so a slash line keeps its meaning in later turns.

Shapes: "heads" N are the selection units flattened over the batch, (B * Hq) for per-query-head
lines or (B * H) for per-KV-head lines; scores are [N, R, S] for R sampled rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from turnkv.attention.triton import available


@dataclass
class Keys:
    """What a prefill chunk attends to, as Step hands it to a pattern.

    q [B, Hq, T, D]; k, v [B, H, S, D]; q_pos [B, T]; k_pos [B, H, S]; valid [B, H, S] (False past a
    head's length) or None; window: a sliding window of the model, or None. The rows of every
    sequence are consecutive positions (a chunk of one conversation's prefill)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    valid: torch.Tensor | None
    first_position: int  # the chunk's rows span [first_position, end_position), known on the host
    end_position: int
    window: int | None = None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def visible(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Causal visibility [B, H, R, S] of the rows (indices into T; all rows when None)."""
        q_pos = self.q_pos if rows is None else self.q_pos[:, rows]
        delta = q_pos[:, None, :, None] - self.k_pos[:, :, None, :]
        mask = delta >= 0
        if self.valid is not None:
            mask &= self.valid[:, :, None, :]
        if self.window is not None:
            mask &= delta < self.window
        return mask

    def row_slice(self, start: int, stop: int) -> "Keys":
        """The chunk's rows [start, stop) over the same keys (first/end_position stay the chunk's)."""
        return replace(self, q=self.q[:, :, start:stop], q_pos=self.q_pos[:, start:stop])

    def offsets(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Diagonal offsets q_pos - k_pos [B, H, R, S], clamped at 0 (negative cells are masked anyway)."""
        q_pos = self.q_pos if rows is None else self.q_pos[:, rows]
        return (q_pos[:, None, :, None] - self.k_pos[:, :, None, :]).clamp_min(0)


def per_unit(x: torch.Tensor, group: int, per_query_head: bool) -> torch.Tensor:
    """A per-KV-head tensor [B, H, ...] as one row per selection unit: [B*Hq, ...] or [B*H, ...]."""
    if per_query_head and group > 1:
        x = x.repeat_interleave(group, dim=1)
    return x.reshape(-1, *x.shape[2:])


def sample_weights(keys: Keys, rows: torch.Tensor, scale: float | None = None,
                   row_positions: list[list[int]] | None = None) -> torch.Tensor:
    """Exact softmax of the chosen rows over all their causal keys, fp32 [B, Hq, R, S] (Alg. 5 line 4).

    row_positions: rows_at_entries(keys, rows) when known. With every head's keys at their entries,
    no padding and no window, row r at position p sees exactly the entries up to p: its masked cells
    are then a slice of the row, filled in place, instead of the mask of every cell."""
    B, Hq, _, D = keys.q.shape
    H, G = keys.k.shape[1], keys.group
    # The scale on the few sampled queries, not on the [.., R, S] scores (a pass over 0.8 GB at 128K).
    q = keys.q[:, :, rows].float().mul_(scale if scale is not None else D**-0.5).view(B, H, G, len(rows), D)
    scores = torch.einsum("bhgrd,bhsd->bhgrs", q, keys.k.float())
    if row_positions is not None and keys.valid is None and keys.window is None:
        for b, positions in enumerate(row_positions):
            for r, p in enumerate(positions):
                scores[b, :, :, r, p + 1:] = float("-inf")
    else:
        scores.masked_fill_(~keys.visible(rows)[:, :, None], float("-inf"))  # in place: [.., R, S] is large
    return scores.softmax(dim=-1).reshape(B, Hq, len(rows), -1)


def line_sums(weights: torch.Tensor, offsets: torch.Tensor | None, num_offsets: int,
              row_positions: list[list[int]] | None = None):
    """Column and diagonal sums of sampled weights [N, R, S] and their largest single entries (w^max).

    Returns w_v, v_max [N, S] and w_s, s_max [N, num_offsets] (LoopServe's Algorithm 5, line 5).
    The diagonals come from either
    - offsets [N, R, S], the cells' diagonal offsets: a scatter over them, for any key positions; or
    - row_positions [B][R] (N = B * units), the sampled rows' positions per sequence, when every valid
      key entry c sits at position c (rows_at_entries; offsets may then be None): row r at position p
      has offset d at entry p - d, so its diagonals are a reversed slice of the row, read in place
      (diagonal_sums). Same results: the sums added in the same order (row by row, as the scatter
      adds them on a CPU), the maxima exact."""
    w_v = weights.sum(dim=1)
    v_max = weights.amax(dim=1)
    if row_positions is not None:
        return (w_v, v_max, *diagonal_sums(weights, row_positions, num_offsets))
    N = weights.shape[0]
    flat_w, flat_d = weights.reshape(N, -1), offsets.reshape(N, -1)
    w_s = weights.new_zeros(N, num_offsets).scatter_add_(1, flat_d, flat_w)
    s_max = weights.new_zeros(N, num_offsets).scatter_reduce_(1, flat_d, flat_w, "amax", include_self=True)
    return w_v, v_max, w_s, s_max


def rows_at_entries(keys: Keys, rows: torch.Tensor) -> list[list[int]] | None:
    """The positions [B][R] of the rows (indices into T) on the host when every valid key entry c of
    every head sits at position c (no eviction holes, so line_sums can read diagonals in place), else
    None. One host read."""
    B, H, S = keys.k_pos.shape
    at = keys.k_pos == torch.arange(S, device=keys.k_pos.device)
    if keys.valid is not None:
        at |= ~keys.valid
    positions = keys.q_pos[:, rows].long()
    packed = torch.cat([at.all().long().view(1), positions.reshape(-1)]).tolist()
    return [packed[1 + b * len(rows): 1 + (b + 1) * len(rows)] for b in range(B)] if packed[0] else None


def diagonal_sums(weights: torch.Tensor, row_positions: list[list[int]], num_offsets: int,
                  force_triton: bool = False):
    """Diagonal sums and maxima w_s, s_max [N, num_offsets] of weights [N, R, S] whose key entry c sits
    at position c; row_positions [B][R] are the rows' positions per sequence (N = B * units).

    On CUDA (or anywhere with force_triton) a Triton kernel (turnkv/attention/triton/diagonals.py)
    reads every weight once. Here, the reference: offsets are accumulated reversed,
    e = num_offsets - 1 - d, so row r at position p has e at entry e + p - num_offsets + 1 and each row
    adds one forward slice of itself, in place. Both add the rows in order, from zero, so the sums are
    bitwise equal to each other and to line_sums' scatter on a CPU; the maxima are exact. A Python
    loop over the B * R sampled rows (one add and one max each), none over heads."""
    if (force_triton or weights.is_cuda) and weights.dtype == torch.float32 and weights.stride(2) == 1:
        kernel = _diagonals_kernel()
        if kernel is not None:
            return kernel.diagonal_sums(weights, row_positions, num_offsets)
    N, _, S = weights.shape
    O = num_offsets
    U = N // len(row_positions)
    total, top = weights.new_zeros(N, O), weights.new_zeros(N, O)
    for b, positions in enumerate(row_positions):
        units = slice(b * U, (b + 1) * U)
        for r, p in enumerate(positions):
            shift = p - O + 1
            e0, e1 = max(0, -shift), min(O, S - shift)
            if e0 >= e1:
                continue
            src = weights[units, r, e0 + shift: e1 + shift]
            total[units, e0:e1] += src
            dst = top[units, e0:e1]
            torch.maximum(dst, src, out=dst)
    return total.flip(1), top.flip(1)


@functools.cache
def _diagonals_kernel():
    if not available():
        return None
    from turnkv.attention.triton import diagonals as kernel

    return kernel


def line_mask(keys: Keys, vertical: torch.Tensor, slash: torch.Tensor, per_query_head: bool,
              rows: torch.Tensor | None = None, at_entries: bool = False) -> torch.Tensor:
    """Cells of the selected lines, restricted to the causal region.

    vertical [N, S] bool over key entries; slash [N, num_offsets] bool over offsets. Returns
    [B, Hq or H, R, S]: per query head when per_query_head, else per KV head. at_entries: the caller
    knows that every head's key entry c sits at position c (kernel_layout's case), so the offsets
    and the causal test are computed once per sequence instead of per head; the same mask."""
    B, Hq = keys.q.shape[:2]
    H = keys.k.shape[1]
    units = Hq if per_query_head else H
    G_units = units // H
    if at_entries:
        return _line_mask_at_entries(keys, vertical, slash, units, rows)
    visible = keys.visible(rows)  # [B, H, R, S]
    offsets = keys.offsets(rows).clamp_max(slash.shape[1] - 1)
    R, S = visible.shape[2:]
    # The group's query heads share a KV head's offsets: index their slash rows without copying them.
    slash = slash.view(B, H, G_units, -1)
    on_slash = slash.gather(3, offsets.reshape(B, H, 1, R * S).expand(B, H, G_units, R * S))
    mask = visible[:, :, None] & (vertical.view(B, H, G_units, 1, S) | on_slash.view(B, H, G_units, R, S))
    return mask.view(B, units, R, S)


def _line_mask_at_entries(keys: Keys, vertical, slash, units: int, rows) -> torch.Tensor:
    """line_mask where key entry c sits at position c in every head: the row-minus-entry offsets
    [B, R, S] are every head's, so they and the causal test are built once per sequence."""
    B, H, S = keys.k_pos.shape
    q_pos = keys.q_pos if rows is None else keys.q_pos[:, rows]
    R = q_pos.shape[1]
    delta = q_pos[:, :, None] - torch.arange(S, device=q_pos.device)  # [B, R, S]
    visible = delta >= 0
    if keys.window is not None:
        visible &= delta < keys.window
    offsets = delta.clamp_(0, slash.shape[1] - 1).view(B, 1, R * S).expand(B, units, R * S)
    on_slash = slash.view(B, units, -1).gather(2, offsets).view(B, units, R, S)
    mask = (vertical.view(B, units, 1, S) | on_slash) & visible[:, None]
    if keys.valid is not None:
        G_units = units // H
        mask.view(B, H, G_units, R, S).logical_and_(keys.valid[:, :, None, None, :])
    return mask


def blockwise_attention(keys: Keys, mask_fn, scale: float | None = None, block_rows: int = 512):
    """Attention of every new row over the cells mask_fn(rows) -> [B, U, R, S] (U = Hq: a mask per
    query head; U = H: one per KV head), renormalised over them, in blocks of rows so the mask never
    exists for the whole chunk at once (4K x 4K x heads would not fit a CPU's cache, or a GPU's memory
    at 128K). Returns out [B, Hq, T, D] and the computed and causal cell counts per unit [B, U]."""
    B, Hq, T, D = keys.q.shape
    H, G = keys.k.shape[1], keys.group
    out = torch.empty_like(keys.q)
    computed = causal = None
    for r0 in range(0, T, block_rows):
        rows = torch.arange(r0, min(T, r0 + block_rows), device=keys.q.device)
        mask = mask_fn(rows)
        R, S = mask.shape[2:]
        U = mask.shape[1]
        q = keys.q[:, :, rows].reshape(B, H, G * R, D)
        if U == Hq:
            folded = mask.reshape(B, H, G * R, S)
        else:
            folded = mask[:, :, None].expand(B, H, G, R, S).reshape(B, H, G * R, S)
        out[:, :, rows] = F.scaled_dot_product_attention(q, keys.k, keys.v, attn_mask=folded, scale=scale).reshape(B, Hq, R, D)
        visible = keys.visible(rows)
        if U != H:
            visible = visible.repeat_interleave(U // H, dim=1)
        c, v = mask.sum(dim=(2, 3)).double(), visible.sum(dim=(2, 3)).double()
        computed, causal = (c, v) if computed is None else (computed + c, causal + v)
    return out, computed, causal


# ---- the fast path: the Triton line kernel on CUDA ------------------------------------------------

@functools.cache
def _kernel():
    if not available():
        return None
    from turnkv.attention.triton import lines as kernel

    return kernel


def uses_kernel(device: torch.device, force_triton: bool = False) -> bool:
    """The kernel runs on CUDA; force_triton runs it anywhere Triton imports (its interpreter on CPU,
    for tests)."""
    return (force_triton or device.type == "cuda") and _kernel() is not None


def kernel_layout(keys: Keys) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q_start [B], kv_len [B, H]) when the kernel can read `keys`, else None.

    The kernel needs key entry c at position c with a head's valid entries a prefix (no eviction has
    happened, the common case: a first turn, or multi-turn with the full cache) and consecutive rows.
    After eviction (holes in k_pos) the cells still follow from positions, but mapping offsets to key
    ranges would need a search per line and block; those chunks take the reference path instead."""
    B, H, S = keys.k_pos.shape
    T = keys.q_pos.shape[1]
    entries = torch.arange(S, device=keys.k_pos.device)
    at_entry = keys.k_pos == entries
    if keys.valid is None:
        kv_len = torch.full((B, H), S, dtype=torch.long, device=entries.device)
        ok = at_entry.all()
    else:
        kv_len = keys.valid.sum(dim=2)
        ok = (at_entry | ~keys.valid).all() & (keys.valid == (entries < kv_len[..., None])).all()
    q_start = keys.q_pos[:, 0]
    ok &= (keys.q_pos == q_start[:, None] + torch.arange(T, device=q_start.device)).all()
    return (q_start, kv_len) if bool(ok) else None


def _layout_geometry(keys: Keys, per_query_head: bool, q_start: torch.Tensor, kv_len: torch.Tensor):
    """(U, W, expand, q0 [B, 1, 1], L [B, H, 1]) for the kernel's layout: the units, the window (or
    none), the per-KV-head -> per-unit repeat, the chunk's first row and the heads' key counts."""
    B, Hq = keys.q.shape[:2]
    H = keys.k.shape[1]
    U = Hq if per_query_head else H
    W = keys.window if keys.window is not None else 1 << 62
    expand = (lambda x: x.repeat_interleave(U // H, dim=1)) if U != H else (lambda x: x)
    return U, W, expand, q_start.long().view(B, 1, 1), kv_len.long()[..., None]


def causal_counts(keys: Keys, per_query_head: bool, q_start: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """contiguous_counts' causal cell counts [B, U] (fp64) alone: the same values, without lines."""
    B, T = keys.q.shape[0], keys.q.shape[2]
    U, W, expand, q0, L = _layout_geometry(keys, per_query_head, q_start, kv_len)
    p = q0 + torch.arange(T, device=q0.device)  # [B, 1, T]
    causal = ((torch.minimum(p, L - 1) - (p - W + 1).clamp_min(0) + 1).clamp_min(0)).sum(dim=2)  # [B, H]
    return expand(causal).double().view(B, U)


def contiguous_counts(keys: Keys, vertical: torch.Tensor, slash: torch.Tensor, per_query_head: bool,
                      q_start: torch.Tensor, kv_len: torch.Tensor):
    """blockwise_attention's computed and causal cell counts [B, U] for the kernel's layout (entry =
    position), from line geometry instead of masks: slash cells + vertical cells - their crossings.

    Rows p in [q0, q1]; a cell (p, c) is visible when c <= p, c < kv_len and p - c < window."""
    B, H, T = keys.q.shape[0], keys.k.shape[1], keys.q.shape[2]
    U, W, expand, q0, L = _layout_geometry(keys, per_query_head, q_start, kv_len)
    q1 = q0 + T - 1
    causal = causal_counts(keys, per_query_head, q_start, kv_len)
    q0, q1, L = (expand(x.expand(B, H, 1)).reshape(-1, 1) for x in (q0, q1, L))  # per unit [N, 1]
    O, S = slash.shape[1], vertical.shape[1]
    d = torch.arange(O, device=slash.device)
    s_on = slash & (d < W)
    s_cells = (torch.minimum(q1, L - 1 + d) - torch.maximum(q0, d) + 1).clamp_min(0)
    c = torch.arange(S, device=vertical.device)
    v_on = vertical & (c < L)
    v_cells = (torch.minimum(q1, c + W - 1) - torch.maximum(q0, c) + 1).clamp_min(0)
    # A column meets the diagonals d in [q0 - c, q1 - c] (each once): count the selected ones.
    prefix = torch.nn.functional.pad(s_on.long().cumsum(dim=1), (1, 0))  # prefix[:, i] = selected below i
    lo = (q0 - c).clamp(0, O)
    hi = (q1 - c + 1).clamp(0, O).clamp_max(min(W, O))
    crossings = (prefix.gather(1, hi) - prefix.gather(1, lo.clamp_max(hi))).clamp_min(0)
    computed = (s_cells * s_on).sum(dim=1) + (v_cells * v_on).sum(dim=1) - (crossings * v_on).sum(dim=1)
    return computed.double().view(B, U), causal


def line_attention(keys: Keys, vertical: torch.Tensor, slash: torch.Tensor, per_query_head: bool,
                   scale: float | None = None, mask_fn=None, force_triton: bool = False, config: dict | None = None,
                   layout: tuple | None = None):
    """Attention of the chunk's rows over the selected lines (vertical [N, S], slash [N, num_offsets]),
    with blockwise_attention's return values (out, computed, causal).

    The Triton kernel on CUDA (or anywhere with force_triton) when kernel_layout accepts the keys; the
    reference blockwise path otherwise, over mask_fn when given (a pattern's own mask of the same
    cells) or line_mask. layout: kernel_layout(keys), where the caller already has it."""
    # Offsets past the flags would need line_mask's clamp (never the case: callers size slash to the
    # chunk's end position).
    if uses_kernel(keys.q.device, force_triton) and slash.shape[1] >= keys.end_position:
        layout = kernel_layout(keys) if layout is None else layout
        if layout is not None:
            kernel = _kernel()
            q_start, kv_len = layout
            plan = kernel.Plan(vertical, slash, q_start, kv_len, keys.q.shape[2], keys.group, per_query_head,
                               keys.window, kernel.block_m_for(keys.q.dtype, config))
            out = kernel.line_attention(keys.q, keys.k, keys.v, plan, scale, config=config)
            return (out, *contiguous_counts(keys, vertical, slash, per_query_head, q_start, kv_len))
    if mask_fn is None:
        mask_fn = lambda r: line_mask(keys, vertical, slash, per_query_head, r)  # noqa: E731
    return blockwise_attention(keys, mask_fn, scale)
