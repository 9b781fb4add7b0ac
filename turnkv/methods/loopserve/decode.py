"""LoopServe's decode axis: progressive KV selection (Algorithm 6 of the paper).

Per turn: the first `warmup` decode steps read the full KV. At decode step n_o = warmup, and every
`interval` steps after it, each head keeps the top-`budget` of its kept tokens, scored by the summed
softmax attention (over all kept keys) of the last `window` queries; tokens that arrive after a
re-selection are read too until the next one. Nothing is evicted: the full KV stays in the store
because a re-selection may pick any token. The decode step reads the selection through the indexed
decode kernel (engine/selection.py).

Counting: decode step n feeds the n-th generated token, so at n_o = 16 the window of 16 holds the
queries of exactly the 16 generated tokens (the current one included), as the listing reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention import reference, top_k
from turnkv.kv.quant import dequantize
from turnkv.methods.protocols import Decode, DecodeSelection
from turnkv.methods.registry import register


@register("decode", "loopserve")
@dataclass
class LoopServeDecode(Decode):
    """LoopServe progressive decode: per-head top-B re-selected every n_d steps (Alg. 6).

    budget: tokens each head keeps from the history (B, 1024). interval: n_d, steps between
    re-selections (16). warmup: decode steps on the full KV before the first selection (16).
    window: observation queries that score the tokens (None: interval). granularity: "query" (one
    selection per query head) or "kv" (per KV head, the group's scores summed: one read serves the
    group). sinks: positions below it are always kept (0: the paper forces none)."""

    budget: int = 1024
    interval: int = 16
    warmup: int = 16
    window: int | None = None
    granularity: str = "query"
    sinks: int = 0

    def __post_init__(self):
        if self.granularity not in ("query", "kv"):
            raise ValueError(f"granularity must be query or kv, not {self.granularity!r}")
        if self.budget < 1 or self.interval < 1 or self.warmup < 0 or self.sinks < 0:
            raise ValueError("budget and interval must be >= 1, warmup and sinks >= 0")
        if self.window is not None and self.window < 1:
            raise ValueError("window must be >= 1 or None")

    @property
    def observation(self) -> int:
        return self.window if self.window is not None else self.interval

    @property
    def path_independent(self) -> bool:
        """Selections start afresh at every prefill; the first one, at decode step `warmup`, reads
        the last `observation` queries, all of the turn's own decode steps when observation <= warmup.
        A longer window reaches into the prompt's tail and earlier turns: what a conversation
        recorded there depends on where its turns began."""
        return self.observation <= self.warmup

    def new_state(self, num_layers: int) -> ProgressiveSelection:
        return ProgressiveSelection(self, num_layers)


@dataclass
class _Picked:
    """One layer's selection: entries [R, K] (ascending, the first counts[r] valid), and per row the
    entry from which every token is read (the tokens since the selection)."""

    entries: torch.Tensor
    counts: np.ndarray
    recent_from: np.ndarray  # [R]
    step: int


class ProgressiveSelection(DecodeSelection):
    """One conversation's selection state; the engine calls begin() once per forward step, observe()
    per layer with the step's queries, and entries() per layer of a decode step.

    The CUDA-graph decode (engine/graph_selection.py) replays the steps between re-selections: it
    hands in each step's queries of every layer at once (record_step, filed per layer only when the
    window is read), reads what each row reads from read_rows(), and tells by `ticks` (bumped by
    every begin()) whether an eager step ran since it last copied a selection."""

    def __init__(self, config: LoopServeDecode, num_layers: int):
        self.config = config
        self._queries: list[torch.Tensor | None] = [None] * num_layers  # [W, Hq, D], post-RoPE
        self._positions: list[torch.Tensor | None] = [None] * num_layers
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # graphed steps: ([L, Hq, D], [1])
        self.picked: list[_Picked | None] = [None] * num_layers
        self.steps = 0  # decode steps in this turn
        self.ticks = 0  # begin() calls, ever
        self.reselect = False
        self.selections = 0  # re-selections in this turn (counted in layer 0)
        self.version = 0  # bumped whenever a layer's selection is made again
        self.graph_record = None  # engine/graph_selection.py's bookkeeping for this conversation

    def graph_config(self):
        return ("progressive", self.config)

    @property
    def queries(self) -> list[torch.Tensor | None]:
        self._flush()
        return self._queries

    @property
    def positions(self) -> list[torch.Tensor | None]:
        self._flush()
        return self._positions

    def reselects_at(self, steps: int) -> bool:
        """Whether decode step `steps` of a turn makes the selection again (Alg. 6 line 3)."""
        w, n = self.config.warmup, self.config.interval
        return steps == w or (steps > w and (steps - w) % n == 0)

    def begin(self, decoding: bool) -> None:
        self.ticks += 1
        if not decoding:  # a prefill: a new turn starts from warm-up (selections are per turn)
            self.steps, self.reselect, self.selections = 0, False, 0
            self.picked = [None] * len(self.picked)
            return
        self.steps += 1
        self.reselect = self.reselects_at(self.steps)

    def discard_step(self, seq, position: int) -> None:
        """A decode step at `position` was launched and then dropped (its generation had already
        stopped; engine/decode_loop.py): forget its queries, as if it never ran. A re-selection it
        made stays counted in `selections`; the next turn's prefill starts the selection afresh."""
        self.steps -= 1
        self._pending = [p for p in self._pending if int(p[1][-1]) != position]
        for layer, positions in enumerate(self._positions):
            if positions is not None and bool((positions == position).any()):
                keep = positions != position
                self._queries[layer], self._positions[layer] = self._queries[layer][keep], positions[keep]

    def observe(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """q [T, Hq, D] of this step; keeps the last `window` of them (the prompt's tail included)."""
        self._flush()
        self._file(layer, q, positions)

    def record_step(self, q: torch.Tensor, position: torch.Tensor) -> None:
        """A graphed decode step's queries of every layer, q [L, Hq, D] (a copy is kept), position [1]."""
        self._pending.append((q.detach().clone(), position.clone()))
        del self._pending[: -self.config.observation]  # older ones leave the window anyway

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        q = torch.stack([p[0] for p in pending], dim=1)  # [L, T, Hq, D]
        positions = torch.cat([p[1] for p in pending])
        for layer in range(q.shape[0]):
            self._file(layer, q[layer], positions)

    def _file(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        size = self.config.observation
        if self._queries[layer] is not None and q.shape[0] < size:
            q = torch.cat([self._queries[layer], q])
            positions = torch.cat([self._positions[layer], positions])
        self._queries[layer] = q[-size:].detach().clone()
        self._positions[layer] = positions[-size:].clone()

    def stale(self, layer: int, lengths: np.ndarray, steps: int | None = None) -> bool:
        """Whether layer's selection no longer names the right tokens at decode step `steps` (this
        one by default) with the heads holding `lengths` [H] (the step's token included): none made
        yet, or tokens evicted since (an eviction axis in the same recipe shifts entries)."""
        picked = self.picked[layer]
        steps = self.steps if steps is None else steps
        return picked is None or not np.array_equal(
            picked.recent_from[:: picked.recent_from.shape[0] // len(lengths)] + (steps - picked.step) + 1, lengths)

    def entries(self, layer: int, seq):
        """What this decode step reads in `layer` (see engine/selection.py), or None in warm-up."""
        if self.steps < self.config.warmup:
            return None
        lengths = seq.lengths[layer]  # [H], the current token included
        picked = self.picked[layer]
        if self.reselect or self.stale(layer, lengths) or picked.entries is None:  # None: made inside a graph
            self.picked[layer] = self._select(layer, seq)
            self.version += 1
            if layer == 0:
                self.selections += 1
        return self.read_rows(layer, lengths)

    def read_rows(self, layer: int, lengths: np.ndarray):
        """(entries [R, W], counts [R]): per row the selected history tokens, then every token from
        the selection's on (the current one last), for heads holding `lengths` [H]."""
        picked = self.picked[layer]
        rows = picked.entries.shape[0]
        recent_from = picked.recent_from
        total = np.repeat(lengths, rows // len(lengths))
        counts = picked.counts + (total - recent_from)
        width = int(counts.max())
        idx = torch.arange(width, device=picked.entries.device)[None]
        chosen = torch.from_numpy(picked.counts).to(idx.device)[:, None]
        start = torch.from_numpy(recent_from).to(idx.device)[:, None]
        if picked.entries.shape[1]:
            old = picked.entries.gather(1, idx.clamp_max(picked.entries.shape[1] - 1).expand(rows, -1))
        else:
            old = torch.zeros_like(idx).expand(rows, -1)
        return torch.where(idx < chosen, old, start + idx - chosen), counts

    def _select(self, layer: int, seq) -> _Picked:
        """Alg. 6 line 5: per row, the top-budget history tokens by the window's summed attention."""
        cfg = self.config
        lengths = seq.lengths[layer]
        S = int(lengths.max(initial=0))
        q, q_pos = self.queries[layer], self.positions[layer]  # [W, Hq, D], [W]
        device = q.device
        H = len(lengths)
        scores = window_scores(q[None], q_pos[None], seq.pool.k[layer], seq.pool.positions[layer],
                               seq.device_table()[layer][None], torch.from_numpy(lengths).to(device)[None], S,
                               per_kv=cfg.granularity == "kv", sinks=cfg.sinks,
                               k_scale=seq.pool.k_scale[layer] if seq.pool.quantized else None)[0]  # [rows, S]
        group = scores.shape[0] // H
        # History = everything before the current token, which is read as a recent token.
        recent_from = np.repeat(lengths - 1, group)
        kept = min(cfg.budget, int(recent_from.max()))
        top = top_k.top_k_ascending(scores, kept)
        counts = np.minimum(recent_from, cfg.budget)
        # Rows with fewer history tokens than `kept` picked padding last; push it past the valid ones.
        top = torch.where(top < torch.from_numpy(recent_from).to(device)[:, None], top, S)  # still ascending
        return _Picked(top, counts, recent_from, self.steps)


def window_scores(q: torch.Tensor, qpos: torch.Tensor, k_pool: torch.Tensor, kpos_pool: torch.Tensor,
                  table: torch.Tensor, lengths: torch.Tensor, capacity: int, per_kv: bool = False,
                  sinks: int = 0, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each history key's score for a re-selection: the softmax weights (over every key the head holds)
    of the window queries, summed over the window (and over the query group with per_kv).

    q [B, W, Hq, D] post-RoPE, qpos [B, W] (< 0: an empty window slot); k_pool / kpos_pool one layer's
    keys [pages, page_size, D] and positions; table [B, H, P] page ids, lengths [B, H] (the current
    token included) -> fp32 [B, X, capacity] (X = H with per_kv, else Hq), -inf past the history
    (which ends before the current token), +inf at history positions below `sinks`. A window query
    sees the keys at positions up to its own. The eager re-selection and the graphed one (the Triton
    kernel turnkv/attention/triton/window_scores.py is checked against this) share it. A quantized
    pool passes its key codes as k_pool and their scales k_scale [pages, page_size]."""
    B, W, Hq, D = q.shape
    H = table.shape[1]
    keys = reference.gather_pages(k_pool, table, capacity)  # [B, H, S, D]
    if k_scale is not None:
        keys = dequantize(keys, reference.gather_pages(k_scale, table, capacity), q.dtype)
    key_pos = reference.gather_pages(kpos_pool, table, capacity)  # [B, H, S]
    j = torch.arange(capacity, device=q.device)
    lengths = lengths.long()
    valid = j < lengths[..., None]
    mask = valid[:, :, None, :] & (key_pos[:, :, None, :] <= qpos[:, None, :, None])  # [B, H, W, S]
    weights = reference.attention_weights(q.transpose(1, 2), keys, mask)  # [B, Hq, W, S]
    weights = torch.where((qpos >= 0)[:, None, :, None], weights, 0.0)  # empty slots (all masked: NaN)
    scores = weights.sum(dim=2)
    if per_kv and Hq != H:
        scores = scores.view(B, H, Hq // H, capacity).sum(dim=2)
    group = scores.shape[1] // H
    history = j < (lengths - 1).repeat_interleave(group, dim=1)[..., None]
    scores = scores.masked_fill(~history, float("-inf"))
    if sinks:
        sink = key_pos.repeat_interleave(group, dim=1) < sinks
        scores = scores.masked_fill(history & sink, float("inf"))
    return scores
