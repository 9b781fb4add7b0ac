"""LoopServe's prefill axis: online vertical/slash line selection per layer and head (Algorithm 5),
then the chunk's attention over only the selected lines."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention import chunk, lines, reference
from turnkv.methods.loopserve.greedy import chosen, greedy
from turnkv.methods.prefill.pattern_hook import clock as _clock
from turnkv.methods.protocols import Prefill
from turnkv.methods.registry import register

_FORCED = 1e9  # added to a forced line's sort key so it sorts first; sums never come near it


@register("prefill", "loopserve")
@dataclass
class LoopServePrefill(Prefill):
    """LoopServe adaptive vertical/slash prefill lines (Alg. 5).

    alpha: sampled attention mass the lines must recover (0.955 in the paper's main table).
    samples: query rows sampled per chunk (48); sampling: "random" (seeded, without replacement) or
    "strided" (evenly spaced). wmax: the overlap bound w^max, "max" (largest entry of the line on the
    sample) or "zero" (no overlap correction). lengths: "full" (cells in the whole chunk,
    the compute cost) or "sampled" (cells on the sampled rows). compare: "normalised" (gain per new
    cell, the listing) or "raw" (the paper's prose). force_sink: key positions below it are forced
    vertical lines; force_local: offsets below it are forced slash lines (1: the diagonal, which keeps
    every row's key set non-empty). max_lines: cap per head, None for none. granularity: "query"
    (lines per query head) or "kv" (per KV head, from the group's summed attention). profile: time the
    stages (synchronises the GPU between them). dense_above: a unit (head) whose selected lines cover
    at least this fraction of its causal cells attends densely instead (every cell, on the dense
    kernel: the line kernel would compute nearly as many cells, each slower); None: always the lines.
    With lengths="full", where a unit may go dense (_may_go_dense, and the kernel's layout), the
    greedy stops a unit as soon as the lines taken so far cover that many cells (greedy.py's early
    stop, a lower bound of the cells): it would go dense whatever it took next, so its decision and
    output are those of the whole walk. Its statistics (vertical, slash, estimated, recovered)
    then describe the lines taken up to the stop, not the whole walk's."""

    alpha: float = 0.955
    samples: int = 48
    seed: int = 0
    sampling: str = "random"
    wmax: str = "max"
    lengths: str = "full"
    compare: str = "normalised"
    force_sink: int = 0
    force_local: int = 1
    max_lines: int | None = None
    granularity: str = "query"
    profile: bool = False
    dense_above: float | None = 0.25

    def __post_init__(self):
        choices = dict(sampling=("random", "strided"), wmax=("max", "zero"), lengths=("full", "sampled"),
                       compare=("normalised", "raw"), granularity=("query", "kv"))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], not {self.alpha}")
        if self.samples < 1 or self.force_sink < 0 or self.force_local < 0:
            raise ValueError("samples must be >= 1, force_sink and force_local >= 0")
        if self.max_lines is not None and self.max_lines < 1:
            raise ValueError("max_lines must be >= 1 or None")
        if self.dense_above is not None and not 0 <= self.dense_above <= 1:
            raise ValueError(f"dense_above is a fraction of the causal cells in [0, 1] or None, not {self.dense_above}")

    # ---- the stages -------------------------------------------------------------------------------
    def sample_rows(self, num_rows: int, layer: int, first_position: int, device) -> torch.Tensor:
        """Alg. 5 line 1: the sampled rows of the chunk, ascending. Seeded by (seed, layer, chunk start)
        so a run is reproducible and layers do not share one sample."""
        if num_rows <= self.samples:
            return torch.arange(num_rows, device=device)
        if self.sampling == "strided":
            rows = torch.linspace(0, num_rows - 1, self.samples).round().long()
        else:
            # Draws `samples` distinct rows without permuting all of them: a permutation of a long
            # chunk's rows costs host time per layer that would dominate the selection.
            rng = np.random.default_rng(hash((self.seed, layer, first_position)) & 0x7FFFFFFF)
            rows = torch.from_numpy(np.sort(rng.choice(num_rows, self.samples, replace=False)))
        return rows.to(device)

    def select(self, keys: lines.Keys, layer: int, times: dict | None = None, stop_cells: torch.Tensor | None = None):
        """Alg. 5 lines 1-17 for every unit of the layer at once. Returns the selected vertical [N, S] and
        slash [N, num_offsets] lines, the sampled weights per unit [B, U, R, S], the sampled rows, the
        greedy's mass estimate [N] and the sampled mass [N]. `times` gets the clock after Random-Select.
        stop_cells [N] or None: the greedy's early stop (greedy.greedy), in the cells of this method's
        lengths; _stop_cells gives it where it cannot change a unit's dense decision."""
        B, Hq, T, _ = keys.q.shape
        H, G = keys.k.shape[1], keys.group
        per_q = self.granularity == "query"
        U = Hq if per_q else H
        q_start, q_end = keys.first_position, keys.end_position
        rows = self.sample_rows(T, layer, q_start, keys.q.device)
        R = len(rows)
        # Keys at their entries (no eviction yet): the rows' positions on the host (one read), for
        # in-place masking and diagonals read in place; else a mask and a scatter over offsets.
        positions = lines.rows_at_entries(keys, rows)
        weights = lines.sample_weights(keys, rows, row_positions=positions)  # [B, Hq, R, S]
        if not per_q:
            weights = weights.view(B, H, G, R, -1).sum(dim=2)
        weights = weights.reshape(B * U, R, -1)
        num_offsets = q_end
        offsets = lines.per_unit(keys.offsets(rows), G, per_q) if positions is None else None
        w_v, v_max, w_s, s_max = lines.line_sums(weights, offsets, num_offsets, positions)
        if self.wmax == "zero":
            v_max, s_max = torch.zeros_like(v_max), torch.zeros_like(s_max)
        if times is not None:
            times["random_select"] = _clock(keys.q.device, self.profile)

        k_pos = lines.per_unit(keys.k_pos, G, per_q)  # [N, S]
        valid = lines.per_unit(keys.valid, G, per_q) if keys.valid is not None else torch.ones_like(k_pos, dtype=torch.bool)
        delta = torch.arange(num_offsets, device=k_pos.device)
        if self.lengths == "full":  # rows p in [max(h, c), n_i)
            l_v = (q_end - k_pos.clamp_min(q_start)).float()
            l_s = (q_end - delta.clamp_min(q_start)).float().expand(B * U, -1)
        else:
            q_rows = keys.q_pos[:, rows]  # [B, R]
            q_rows = q_rows.repeat_interleave(U, dim=0)  # [N, R]
            l_v = (q_rows[:, :, None] >= k_pos[:, None, :]).sum(dim=1).float()
            l_s = (q_rows[:, :, None] >= delta[None, None, :]).sum(dim=1).float()

        forced_v = valid & (k_pos < self.force_sink)
        forced_s = (delta < self.force_local).expand(B * U, -1)
        key_v = torch.where(valid, w_v + forced_v * _FORCED, float("-inf"))
        order_v = key_v.argsort(dim=1, descending=True, stable=True)
        order_s = (w_s + forced_s * _FORCED).argsort(dim=1, descending=True, stable=True)
        sv = lambda x: x.gather(1, order_v)  # noqa: E731
        ss = lambda x: x.gather(1, order_s)  # noqa: E731
        mass = weights.sum(dim=(1, 2))  # = R (or G * R per KV head): softmax rows sum to 1
        n_s = torch.full((B * U,), num_offsets, device=mass.device)
        i, j, estimate = greedy(ss(w_s), ss(s_max), ss(l_s), n_s, sv(w_v), sv(v_max), sv(l_v), valid.sum(dim=1),
                                self.alpha * mass, forced_s.sum(dim=1), forced_v.sum(dim=1),
                                normalised=self.compare == "normalised", max_lines=self.max_lines,
                                max_forced=max(self.force_local, self.force_sink), stop_cells=stop_cells)
        return chosen(order_v, j), chosen(order_s, i), weights.view(B, U, R, -1), rows, estimate, mass

    def attend(self, layer: int, keys: lines.Keys):
        """The chunk's attention over its selected lines, and the stage statistics of this layer."""
        per_q = self.granularity == "query"
        device = keys.q.device
        t0 = _clock(device, self.profile)
        B, U = keys.q.shape[0], keys.q.shape[1] if per_q else keys.k.shape[1]
        times = {}
        layout = lines.kernel_layout(keys) if self._may_go_dense(keys) else None
        stop_cells = self._stop_cells(keys, per_q, layout) if layout is not None else None
        vertical, slash, weights, rows, estimate, mass = self.select(keys, layer, times, stop_cells)
        t2 = _clock(device, self.profile)
        dense = self._dense_units(keys, vertical, slash, per_q, layout) if layout is not None else None
        if dense is None:
            # The Triton line kernel on CUDA, the reference mask path elsewhere (lines.line_attention).
            out, computed, causal = lines.line_attention(keys, vertical, slash, per_q, layout=layout)
        else:
            out, computed, causal = self._attend_dense_units(keys, vertical, slash, per_q, *dense, layout)
        t3 = _clock(device, self.profile)
        mask = lines.line_mask(keys, vertical, slash, per_q, rows, at_entries=layout is not None)
        covered = (weights * mask).sum(dim=(2, 3))
        stats = dict(layer=layer, computed=computed, causal=causal,
                     vertical=vertical.sum(dim=1).view(B, U), slash=slash.sum(dim=1).view(B, U),
                     recovered=covered / mass.view(B, U), estimated=estimate.view(B, U) / mass.view(B, U),
                     time_random_select=times["random_select"] - t0, time_search=t2 - times["random_select"],
                     time_sparse_attention=t3 - t2)
        return out, stats

    def _may_go_dense(self, keys: lines.Keys) -> bool:
        """Dense attention needs every head to hold the same keys at their positions, and no window
        (lines.kernel_layout's case, which the caller then reads)."""
        return self.dense_above is not None and keys.window is None and keys.valid is None

    def _stop_cells(self, keys: lines.Keys, per_q: bool, layout) -> torch.Tensor | None:
        """The greedy's early stop per unit [N] (fp64): dense_above times the unit's causal cells, the
        threshold _dense_units compares, in the same operation. None without lengths="full"; inf for
        a sequence whose rows are not [first_position, end_position).

        Why a stopped unit goes dense: with every key entry at its position (the layout), no window and
        rows [first_position, end_position) over at least end_position keys, select's l_s is exactly
        contiguous_counts' cells of each slash line and l_v at most those of each vertical line, and
        contiguous_counts counts the union of the lines' cells. The greedy's bound is at most that
        union for the lines taken at the stop, the whole walk takes a superset of them, and the union
        only grows: computed >= bound >= stop_cells = dense_above * causal, the same fp64 value."""
        if self.lengths != "full":
            return None
        T = keys.q.shape[2]
        if keys.end_position - keys.first_position != T or keys.k.shape[2] < keys.end_position:
            return None
        q_start, kv_len = layout
        stop = self.dense_above * lines.causal_counts(keys, per_q, q_start, kv_len)  # [B, U]
        stop = torch.where((q_start == keys.first_position)[:, None], stop, float("inf"))
        return stop.reshape(-1)

    def _dense_units(self, keys: lines.Keys, vertical, slash, per_q: bool, layout):
        """(dense [B, U] bool, causal [B, U]): the units whose lines cover at least dense_above of their
        causal cells, and every unit's causal count; None where no unit does. A unit decides alone, so
        a tensor-parallel rank decides as N=1."""
        computed, causal = lines.contiguous_counts(keys, vertical, slash, per_q, *layout)
        dense = computed >= self.dense_above * causal
        return (dense, causal) if bool(dense.any()) else None

    def _attend_dense_units(self, keys: lines.Keys, vertical, slash, per_q: bool, dense, causal, layout):
        """Dense attention for the `dense` units [B, U], their lines elsewhere: (out, computed, causal).
        Where some units keep lines, the dense units' lines shrink to the diagonal for the line pass,
        and the dense pass runs only over the KV heads holding a dense unit; its rows replace theirs."""
        if bool(dense.all()):
            return _every_cell(keys.q, keys.k, keys.v), causal, causal
        flat = dense.reshape(-1)
        vertical = vertical & ~flat[:, None]
        slash = torch.where(flat[:, None], torch.arange(slash.shape[1], device=slash.device) == 0, slash)
        out, computed, _ = lines.line_attention(keys, vertical, slash, per_q, layout=layout)
        B, Hq = keys.q.shape[:2]
        H = keys.k.shape[1]
        G = Hq // H
        per_head = dense if per_q else dense.repeat_interleave(Hq // dense.shape[1], dim=1)  # [B, Hq]
        heads = per_head.view(B, H, G).any(dim=2).any(dim=0).nonzero().flatten()  # KV heads with a dense unit
        rows = (heads[:, None] * G + torch.arange(G, device=heads.device)).flatten()
        every = _every_cell(keys.q[:, rows], keys.k[:, heads], keys.v[:, heads])
        out[:, rows] = torch.where(per_head[:, rows, None, None], every, out[:, rows])
        return out, torch.where(dense, causal, computed), causal


def _every_cell(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the chunk's T rows q [B, Hq, T, D] over every key k, v [B, H, S, D] (each
    head holds the same S keys at their entries, the chunk's last), on the paths the full cache's
    chunk takes: a fresh chunk's causal kernel, the split history path over a long history
    (chunk.uses_split), else SDPA bottom-right."""
    T, S = q.shape[2], k.shape[2]
    if S == T:
        return chunk.fresh_causal(q, k, v)
    if chunk.uses_split(q.device, q.dtype, T, S - T):
        h = S - T
        return chunk.split_history(q, k[:, :, :h], v[:, :, :h], k[:, :, h:], v[:, :, h:])
    return reference.causal_suffix(q, k, v)
