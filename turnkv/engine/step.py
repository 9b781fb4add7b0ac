"""One forward step over a batch of conversations: where each layer writes its K/V in the page pool,
and the attention it runs over what the conversations keep."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from turnkv import gpu
from turnkv.attention import chunk, decode, flash, lines, reference, streaming
from turnkv.engine import selection
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.protocols import NO_WINDOW
from turnkv.methods.step_context import PLAIN, StepContext


# The longest chunk whose per-head windows the paged chunk kernel applies (docs/benchmarks.md).
WINDOWED_CHUNK_ROWS = 4096


class _Heads(NamedTuple):
    """Some KV heads of one layer: their columns (None: every head), page tables [B, n, P] (None in a
    fresh step), lengths [B, n] on the device, the longest length and whether lengths differ (host)."""

    index: slice | None
    tables: torch.Tensor | None
    lengths: torch.Tensor
    max_len: int
    padded: bool


class Step:
    """Implements the decoder's AttentionStep for B sequences that each add T tokens.

    Built after every sequence has reserved its slots (SequenceKV.reserve). A batch whose sequences
    are all fresh (no history, equal lengths) takes the plain causal path and reads nothing back.
    """

    def __init__(self, pool: PagePool, seqs: list[SequenceKV], slots: list[torch.Tensor], positions: torch.Tensor,
                 sliding_window: int | None = None, contexts: list[StepContext | None] | None = None,
                 decoding: bool = False):
        num_new = positions.shape[1]
        contexts = [c or PLAIN for c in contexts] if contexts else [PLAIN] * len(seqs)
        # A batch shares its accumulation (H2O adds every query's weights to the keys' mass); the
        # prefill pattern is a chunk's (T > 1) of one sequence. None where nothing is asked, so the
        # dense paths below stay untouched.
        self.accumulate = contexts[0].accumulate
        if any(c.accumulate != self.accumulate for c in contexts):
            raise ValueError("a batch's conversations must agree on attention accumulation")
        self.pattern = contexts[0].pattern if num_new > 1 else None
        # selectors[b] picks the slots sequence b reads in each layer of a decode step (decoding: this
        # step is one, not a prefill of one token), and watches every step's queries.
        selectors = [c.selector for c in contexts]
        self.selectors = selectors if any(s is not None for s in selectors) else None
        self.observers = self.selectors
        self.seqs = seqs
        # Per sequence a QueryWindow (or None) that records each layer's queries for the scorers.
        windows = [c.window for c in contexts]
        self.windows = windows if any(w is not None for w in windows) else None
        self._step_queries: list[torch.Tensor] = []  # a one-token step's q per layer, until the last
        accumulate = self.accumulate
        self.pool, self.num_new = pool, num_new
        self.sliding_window = sliding_window
        # [L, B*H*T]: one flat index list per layer, in (sequence, head, token) order.
        self.slots = torch.stack(slots, dim=1).reshape(pool.num_layers, -1)
        lengths = np.stack([s.lengths for s in seqs], axis=1)  # [L, B, H], after this step's tokens
        # The sliding window needs positions, which only the general path reads.
        self.fresh = bool((lengths == num_new).all()) and sliding_window is None and not accumulate
        self.max_len = lengths.max(axis=(1, 2)).tolist()
        self.padded = (lengths.min(axis=(1, 2)) != lengths.max(axis=(1, 2))).tolist()
        self.lengths = gpu.upload(lengths, pool.device)
        if not self.fresh:
            self.tables = _tables(seqs)
        self.query_positions = positions  # [B, T]
        # Decode reads the kept keys through the indexed decode kernel (H2O's attention mass needs
        # the weights themselves, so it stays on the reference path).
        self.indexed = num_new == 1 and not self.fresh and not accumulate
        if self.indexed:
            self.tables = self.tables.to(torch.int32)
            self.lengths = self.lengths.to(torch.int32)
            self.splits = decode.num_splits(pool.device, len(seqs) * pool.num_kv_heads, max(self.max_len),
                                           pool.kv_dtype)
        # Later chunks and later turns (T > 1 over kept history) read the pool in place through the paged
        # chunk kernel where it is switched on (attention/chunk.py); H2O's accumulation needs the weights.
        self.chunk_kernel = num_new > 1 and not self.fresh and not accumulate and chunk.uses_kernel(pool.device)
        # A pattern that is causal attention within windows per head (streaming heads) runs on the
        # paths below: without windows on any of them, with windows on the chunk kernel for chunks of
        # up to WINDOWED_CHUNK_ROWS, else split_heads.
        self.head_windows, self.sink = None, 0
        # split_heads: the pattern's windowed heads and its whole heads run apart, the whole heads on the
        # dense paths below and the windowed ones on the chunk kernel's ring iterator where it runs
        # (it visits only their sink's and window's tiles), else on attention/streaming.py's block
        # decomposition (a chunk the windowed chunk kernel does not take whole: fresh, longer than
        # WINDOWED_CHUNK_ROWS, or off the kernel's devices).
        self.split_heads, self._windows_np, self.ring = False, None, False
        if self.pattern is not None and sliding_window is None and not accumulate:
            windows = self.pattern.chunk_windows(seqs, num_new)
            if windows is not None:
                self.pattern, self.sink = None, windows.sink
                if windows.windows is not None:  # [L, H]
                    self._windows_np = np.ascontiguousarray(windows.windows)  # rows: the kernel's [H] windows
                    self.head_windows = torch.from_numpy(self._windows_np).to(pool.device, torch.int32)
                    self.split_heads = not (self.chunk_kernel and num_new <= WINDOWED_CHUNK_ROWS)
                    # Windows come from heads in ring form (chunk_windows): the kernel's ring iterator.
                    self.ring = chunk.uses_kernel(pool.device) and chunk.kernel_takes(pool.head_dim)
                    if self.ring and self.split_heads:
                        self._ring_heads = _ring_heads(self._windows_np, pool.device)
                        if self.fresh:
                            self.tables = _tables(seqs)
        self._lengths_np = lengths
        # Later chunks with work enough go to FlashAttention-4 where it is installed (attention/flash.py):
        # heads without window or sink, a pool in the compute dtype. It reads int32 tables and lengths,
        # converted at the first layer that takes it.
        self.flash_history = (num_new > 1 and not self.fresh and not accumulate and self.pattern is None
                              and (self.head_windows is None or self.split_heads)
                              and (self.sink == 0 or self.split_heads) and sliding_window is None
                              and not pool.quantized and flash.usable(pool.device, pool.dtype, pool.head_dim))
        self._flash_args = None
        if self.pattern is not None:
            before = [s.next_position - num_new for s in seqs]
            self.span = (min(before), max(before) + num_new)  # host ints: no device read per layer
        if self.selectors is not None:
            for sel in self.selectors:
                if sel is not None:
                    sel.begin(decoding)
            if not (self.indexed and decoding):
                self.selectors = None
        # Per layer, each class of selections observes the queries in one call, and selectors that keep
        # statistics beside the pages (LServe's per-page key min/max) take every K write of their
        # sequences, prefill and decode, one call per group of equal write_key (engine/selection.py).
        self.observe_groups, self.writers = [], []
        if self.observers is not None:
            self.observe_groups = selection.observer_groups(self.observers, pool.device)
            self.writers = selection.write_groups(self.observers, seqs, num_new, pool.device)

    def _record_windows(self, layer: int, q: torch.Tensor) -> None:
        """Hand q [B, T, Hq, D] to the observation windows. A one-token step hands every layer's at
        once after the last layer (QueryWindow.record_all): one copy per sequence and step, not one
        per layer (a batch of 64 at 32 layers would file 2048 times a step)."""
        if self.num_new > 1:
            for b, window in enumerate(self.windows):
                if window is not None:
                    window.record(layer, q[b], self.query_positions[b])
            return
        self._step_queries.append(q)
        if len(self._step_queries) < self.pool.num_layers:
            return
        queries = torch.stack(self._step_queries)  # [L, B, 1, Hq, D]
        self._step_queries = []
        for b, window in enumerate(self.windows):
            if window is not None:
                window.record_all(queries[:, b], self.query_positions[b])  # a copy per sequence

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, Hq, D = q.shape
        self.pool.write_heads(layer, self.slots[layer], k, v)
        if self.writers:
            slots = self.slots[layer].view(B, k.shape[2], T)  # (sequence, head, token) order
            for rows, written in self.writers:  # the sequences' keys as they are, [m, T, H, D]
                written(layer, rows.of(slots), rows.of(k))
        if self.windows is not None:
            self._record_windows(layer, q)
        for cls, sels, rows in self.observe_groups:
            cls.observe_batch(layer, sels, rows.of(q), rows.of(self.query_positions))
        q = q.transpose(1, 2)
        if self.pattern is not None:
            return self._pattern_attention(layer, q, k, v).transpose(1, 2)
        if self.selectors is not None:
            picked = selection.tables(self, layer, q[:, :, 0])
            if picked is not None:  # some sequence reads a selection: every row becomes a slot list
                table, lengths, splits = picked
                D = q.shape[-1]
                out = decode.indexed_decode(
                    q[:, :, 0], self.pool.k[layer].view(-1, 1, D), self.pool.v[layer].view(-1, 1, D), table, lengths,
                    splits, window=self.sliding_window, key_positions=self.pool.positions[layer].view(-1, 1),
                    query_positions=self.query_positions[:, 0], **self.pool.scale_kwargs(layer, slots=True))
                return out[:, None]
        if self.split_heads:
            return self._split_heads_attention(layer, q, k, v)
        return self._dense_attention(layer, q, k, v, self._heads(layer)).transpose(1, 2)

    def _heads(self, layer: int, head: int | None = None) -> _Heads:
        """The layer's page tables and lengths for one KV head (None: all of them), as views."""
        if head is None:
            return _Heads(None, None if self.fresh else self.tables[layer], self.lengths[layer],
                          self.max_len[layer], self.padded[layer])
        index = slice(head, head + 1)
        lengths = self._lengths_np[layer][:, index]
        return _Heads(index, None if self.fresh else self.tables[layer][:, index],
                      self.lengths[layer][:, index], int(lengths.max()), bool(lengths.min() != lengths.max()))

    def _dense_attention(self, layer: int, q, k, v, heads: _Heads) -> torch.Tensor:
        """q [B, Hq, T, D] of the KV heads `heads` over everything they keep -> [B, Hq, T, D]; k, v
        [B, T, H, D] are the chunk's own keys and values of those heads."""
        B, Hq, T, D = q.shape
        H = k.shape[2]
        if self.fresh:
            # The new tokens as the store holds them (a quantized pool's round trip), as every other
            # path reads them: attention does not depend on whether a chunk had history.
            k, v = self.pool.round_trip(k), self.pool.round_trip(v)
            return chunk.fresh_causal(q, k.transpose(1, 2), v.transpose(1, 2))
        if self.indexed:
            out = decode.indexed_decode(
                q[:, :, 0], self.pool.k[layer], self.pool.v[layer], heads.tables, heads.lengths,
                self.splits, window=self.sliding_window, key_positions=self.pool.positions[layer],
                query_positions=self.query_positions[:, 0], **self.pool.scale_kwargs(layer))
            return out[:, :, None]
        if self.flash_history and flash.takes_chunk(q.device, B * H, Hq // H, T, heads.max_len):
            if self._flash_args is None:
                self._flash_args = (self.tables.to(torch.int32), self.lengths.to(torch.int32))
            tables, lengths = self._flash_args
            tables, lengths = tables[layer], lengths[layer]
            if heads.index is not None:
                tables, lengths = tables[:, heads.index], lengths[:, heads.index]
            k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
            if flash.takes_gathered(T):
                return flash.gathered(q, k_cache, v_cache, tables, lengths, heads.max_len)
            return flash.paged(q, k_cache, v_cache, tables, lengths)
        if self.chunk_kernel and self._splits_history(heads, T):
            return self._split_attention(layer, q, k, v, heads)
        if self.chunk_kernel:
            splits = chunk.num_splits(q.device, B * H, T, Hq // H, heads.max_len, q.dtype)
            window = self.sliding_window
            if self.head_windows is not None and not self.split_heads:
                window = self.head_windows[layer]
            return chunk.paged_chunk(
                q, self.pool.k[layer], self.pool.v[layer], heads.tables, heads.lengths, splits,
                window=window, key_positions=self.pool.positions[layer], query_positions=self.query_positions,
                sink=0 if self.split_heads else self.sink, ring=self.ring and not self.split_heads,
                **self.pool.scale_kwargs(layer))
        S = heads.max_len
        keys = self.pool.gather(layer, heads.tables, S, "k")
        values = self.pool.gather(layer, heads.tables, S, "v")
        if not heads.padded and self.sliding_window is None and not self.accumulate:
            # Every head holds S tokens, the new ones last: causal from the bottom right, which
            # flash attention runs without a mask tensor.
            return reference.causal_suffix(q, keys, values)
        mask = None
        if heads.padded:
            mask = reference.causal_mask(heads.lengths, T, S)
        elif T > 1:  # every head holds S tokens: one causal mask serves them all
            mask = reference.causal_mask(heads.lengths[:, :1], T, S)
        if self.sliding_window is not None:
            key_pos = reference.gather_pages(self.pool.positions[layer], heads.tables, S)
            in_window = key_pos[:, :, None, :] > self.query_positions[:, None, :, None] - self.sliding_window
            mask = in_window if mask is None else mask & in_window
        if self.accumulate:
            self._accumulate_attention(layer, q, keys, mask)
        return reference.attention(q, keys, values, mask)

    def _split_heads_attention(self, layer: int, q, k, v) -> torch.Tensor:
        """Whole heads on the dense paths, windowed heads (a window and the sink) on the streaming
        block decomposition: q [B, Hq, T, D], k, v [B, T, H, D] -> [B, T, Hq, D]. One KV head (its
        query group) per call, on views: every call has the shapes of one head whatever the layer's
        split, so cuDNN builds one execution plan per chunk length, as for the dense heads of `full`."""
        B, Hq, T, D = q.shape
        H = k.shape[2]
        G = Hq // H
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
        per_head = out.view(B, T, H, G, D)
        q_heads = q.view(B, H, G, T, D)
        windows = self._windows_np[layer]
        for h in np.flatnonzero(windows >= NO_WINDOW).tolist():
            k_h, v_h = k[:, :, h : h + 1], v[:, :, h : h + 1]
            part = self._dense_attention(layer, q_heads[:, h], k_h, v_h, self._heads(layer, h))
            per_head[:, :, h] = part.transpose(1, 2)
        if self.ring:
            # The windowed heads in one launch, read in place from the pool (the chunk is written),
            # straight into their rows of `out`.
            chunk.paged_chunk(q, self.pool.k[layer], self.pool.v[layer], self.tables[layer], self.lengths[layer],
                              window=self.head_windows[layer], key_positions=self.pool.positions[layer],
                              query_positions=self.query_positions, sink=self.sink, ring=True,
                              heads=self._ring_heads[layer], out=out.transpose(1, 2), **self.pool.scale_kwargs(layer))
            return out
        for window in np.unique(windows[windows < NO_WINDOW]).tolist():
            # The windowed heads together: their calls' shapes do not depend on the chunk's length.
            heads = np.flatnonzero(windows == window).tolist()
            q_w = torch.stack([q_heads[:, h] for h in heads], 1).view(B, len(heads) * G, T, D)
            k_w, v_w = (torch.stack([x[:, :, h] for h in heads], 2) for x in (k, v))
            part = self._windowed_attention(layer, q_w, k_w, v_w, heads, window)
            part = part.view(B, len(heads), G, T, D)
            for i, h in enumerate(heads):
                per_head[:, :, h] = part[:, i].transpose(1, 2)
        return out

    def _windowed_attention(self, layer: int, q, k, v, heads: list[int], window: int) -> torch.Tensor:
        """q [B, Hq, T, D] of the KV heads `heads`, which see their sink and `window` positions back,
        over their kept history and the chunk's own k, v [B, T, H, D] -> [B, Hq, T, D]
        (attention/streaming.py)."""
        T = q.shape[2]
        k_new = self.pool.round_trip(k).transpose(1, 2)
        v_new = self.pool.round_trip(v).transpose(1, 2)
        history, layout = None, None
        kept = self._lengths_np[layer][:, heads] - T  # [B, n]
        S = int(kept.max())
        if not self.fresh and S > 0:
            tables = torch.stack([self.tables[layer][:, h] for h in heads], 1)
            lengths = torch.stack([self.lengths[layer][:, h] for h in heads], 1)
            keys = self.pool.gather(layer, tables, S, "k")
            values = self.pool.gather(layer, tables, S, "v")
            positions = reference.gather_pages(self.pool.positions[layer], tables, S)
            valid = torch.arange(S, device=q.device) < (lengths - T)[..., None]
            history = (keys, values, positions, valid)
            # The windows came from heads in their kept form (chunk_windows): each holds its first
            # min(sink, kept) positions, then a run ending right before the chunk. Where every head
            # keeps as many, that is the history's layout.
            if (kept == S).all():
                layout = (min(self.sink, S), S - min(self.sink, S))
        first = min(kv.next_position for kv in self.seqs) - T
        return streaming.windowed_chunk(q, k_new, v_new, self.query_positions, window, self.sink, history,
                                        first_position=first, layout=layout)

    def _splits_history(self, heads: _Heads, num_new: int) -> bool:
        """A long chunk whose heads all hold the same history, with no window: chunk.split_history."""
        return (not heads.padded and self.sliding_window is None and (self.head_windows is None or self.split_heads)
                and chunk.uses_split(self.pool.device, self.pool.dtype, num_new, heads.max_len - num_new))

    def _split_attention(self, layer: int, q, k, v, heads: _Heads):
        """q [B, Hq, T, D] over the history gathered from the pool and the chunk's own K/V k, v [B, T, H, D]
        (as the store holds them: a quantized pool's round trip) -> [B, Hq, T, D]."""
        history = heads.max_len - q.shape[2]
        k_hist = self.pool.gather(layer, heads.tables, history, "k")
        v_hist = self.pool.gather(layer, heads.tables, history, "v")
        k_new, v_new = self.pool.round_trip(k).transpose(1, 2), self.pool.round_trip(v).transpose(1, 2)
        B, Hq, T, D = q.shape
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        return chunk.split_history(q, k_hist, v_hist, k_new, v_new, out=out)

    def _pattern_attention(self, layer, q, k, v):
        """A prefill chunk through the recipe's pattern: q [B, Hq, T, D] over every kept key."""
        B, H, T = q.shape[0], k.shape[2], q.shape[2]
        if self.fresh:
            keys, values = self.pool.round_trip(k).transpose(1, 2), self.pool.round_trip(v).transpose(1, 2)
            key_pos, valid = self.query_positions[:, None, :].expand(B, H, T), None
        else:
            S = self.max_len[layer]
            keys = self.pool.gather(layer, self.tables[layer], S, "k")
            values = self.pool.gather(layer, self.tables[layer], S, "v")
            key_pos = reference.gather_pages(self.pool.positions[layer], self.tables[layer], S)
            valid = torch.arange(S, device=q.device) < self.lengths[layer][..., None] if self.padded[layer] else None
        return self.pattern(layer, lines.Keys(q, keys, values, self.query_positions, key_pos, valid, *self.span,
                                              window=self.sliding_window))

    def _accumulate_attention(self, layer, q, keys, mask):
        B, H, S = keys.shape[0], keys.shape[1], keys.shape[2]
        if mask is None:
            mask = torch.ones(B, 1, q.shape[2], S, dtype=torch.bool, device=q.device)
        mask = mask.expand(B, H, q.shape[2], S)
        weights = reference.attention_weights(q, keys, mask)  # [B, Hq, T, S]
        mass = weights.view(B, H, -1, q.shape[2], S).sum(dim=(2, 3))  # over the group's heads and queries
        ps = self.pool.page_size
        j = torch.arange(S, device=q.device)
        slots = self.tables[layer][:, :, j // ps] * ps + j % ps  # [B, H, S]
        self.pool.attention_mass[layer].view(-1).index_add_(0, slots.reshape(-1), mass.reshape(-1))


def _tables(seqs: list[SequenceKV]) -> torch.Tensor:
    """The sequences' page tables side by side, [L, B, H, P], zero-padded to the widest."""
    width = max(int(s.num_pages.max(initial=0)) for s in seqs)
    tables = [s.device_table()[:, :, :width] for s in seqs]
    # Views where a table holds the width (one copy for the batch, the stack), a padded copy elsewhere.
    return torch.stack([t if t.shape[2] == width else torch.nn.functional.pad(t, (0, width - t.shape[2]))
                        for t in tables], dim=1)


def _ring_heads(windows: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """Per layer the windowed KV heads of windows [L, H] (int32 views of one device copy)."""
    heads = [np.flatnonzero(w < NO_WINDOW) for w in windows]
    flat = torch.from_numpy(np.concatenate(heads).astype(np.int32)).to(device)
    ends = np.cumsum([len(h) for h in heads])
    return [flat[end - len(h) : end] for h, end in zip(heads, ends)]
