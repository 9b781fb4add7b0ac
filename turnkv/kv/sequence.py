"""One conversation's KV inside the page pool.

Each (layer, kv_head) owns a list of pages and a length. Tokens keep their original positions, in
ascending order, so a head that evicted tokens still knows where each kept token came from, and new
tokens continue from the uncompressed position count (`next_position`).

Page tables and lengths live on the host (numpy) for allocation decisions without device syncs; the
device copy of the table is refreshed lazily, only over the columns that changed.

How a table changes, for copies of it kept elsewhere (the CUDA-graph decode step's): appends fill
columns at a head's end; `drop_pages` removes whole pages from inside a head's list (its table shifts
left, `table_edits` counts it per head and `edited_from` bounds the columns it rewrote); `keep`,
`truncate` and `free` release pages from a head's end after compacting (`shrinks` counts them).

Pages may be shared with other holders (`share_from`; the pool counts holders). Before anything is
written into a page another holder has (an append into a shared partial last page, the compaction of
`keep`), the sequence takes a private copy of just that page (`_privatize`): the table column points
to the copy, `shrinks` and the head's `moves` are bumped, as for any page a head gave back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention.reference import gather_pages
from turnkv.gpu import upload
from turnkv.kv.compaction import Compaction
from turnkv.kv.pool import PagePool, layer_pages
from turnkv.kv.token_slots import layer_slots


class SequenceKV(Compaction):
    def __init__(self, pool: PagePool):
        self.pool = pool
        L, H = pool.num_layers, pool.num_kv_heads
        self.lengths = np.zeros((L, H), dtype=np.int64)
        self.num_pages = np.zeros((L, H), dtype=np.int64)
        self.table = np.zeros((L, H, 0), dtype=np.int64)
        self.next_position = 0
        self._table_device: torch.Tensor | None = None
        self._dirty_from = 0  # first table column whose device copy is stale
        # Per (layer, head), the first table column a page was appended at since the device copy was
        # made (uneven heads: a decode step crosses a page in a few heads only).
        self._appended_from = np.full((L, H), np.iinfo(np.int64).max, dtype=np.int64)
        # Bumped whenever keep / truncate / free release pages: table columns below num_pages may then
        # be refilled with other page ids, so a copy of the table kept elsewhere (the CUDA-graph
        # step's) is stale. drop_pages does not bump it: it records its edits per head (below).
        self.shrinks = 0
        # Per (layer, head): bumped whenever the head's tokens move or go (keep, truncate, free,
        # drop_pages), not on appends. Statistics kept beside the pages (LServe's key min/max) rebuild
        # only these heads.
        self.moves = np.zeros((L, H), dtype=np.int64)
        # Per (layer, head): the part of `moves` after which the head holds the same positions in the
        # same order, less its newest (truncate, unreserve, a private copy of a shared page). A head
        # that was the sink plus one run ending at the newest token still is one (streaming heads'
        # rings need no check after them).
        self.ordered_moves = np.zeros((L, H), dtype=np.int64)
        # Per (layer, head): bumped by drop_pages, which shifts the head's table left (no data moves);
        # edited_from is the lowest table column any drop_pages has rewritten (a lower bound kept for
        # good). A copy of the table that saw table_edits[l, h] == e is current again after
        # rewriting columns [min(edited_from, the head's pages it had), num_pages) of the head.
        self.table_edits = np.zeros((L, H), dtype=np.int64)
        self.edited_from = np.full((L, H), np.iinfo(np.int64).max, dtype=np.int64)

    # ---- accounting -------------------------------------------------------------------------
    def tokens(self) -> int:
        """Tokens held, summed over layers and KV heads."""
        return int(self.lengths.sum())

    def bytes(self) -> int:
        """K/V bytes of the pages this conversation owns."""
        return int(self.num_pages.sum()) * self.pool.page_bytes

    def held_pages(self) -> list[np.ndarray]:
        """Per layer, the page ids this sequence holds (every head's)."""
        layers, pages = self.held_by_layer()
        return np.split(pages, np.searchsorted(layers, np.arange(1, len(self.table))))

    def held_by_layer(self) -> tuple[np.ndarray, np.ndarray]:
        """(layers [n], pages [n]): every page this sequence holds with its layer, in layer order."""
        width = int(self.num_pages.max(initial=0))  # the table has room for more: look at the used columns
        mask = np.arange(width)[None, None, :] < self.num_pages[:, :, None]
        return np.nonzero(mask)[0], self.table[:, :, :width][mask]

    def sharing(self) -> tuple[int, int]:
        """(own bytes, shared share): bytes of the pages only this sequence holds, and its share of the
        pages it holds with others (a page's bytes over its number of holders)."""
        refs = self.pool.refs[self.held_by_layer()]
        own, share = int((refs == 1).sum()), float((1.0 / refs[refs > 1]).sum())
        return own * self.pool.page_bytes, int(round(share * self.pool.page_bytes))

    def share_from(self, other: SequenceKV) -> tuple[np.ndarray, np.ndarray]:
        """Hold the same pages as `other` (this sequence must be empty): the same tokens, positions and
        table, every page one holder more. Whichever writes into a shared page first copies it.
        Returns held_by_layer() of both."""
        if self.next_position or self.num_pages.any():
            raise ValueError("share_from needs an empty sequence")
        held = other.held_by_layer()
        self.pool.share(*held)
        self.table = other.table.copy()
        self.lengths, self.num_pages = other.lengths.copy(), other.num_pages.copy()
        self.next_position = other.next_position
        self._table_device, self._dirty_from = None, 0
        self.moves += 1  # written behind the page statistics' back, as a restore is
        # The same positions in the same order as `other`'s: what its heads' moves may have reordered,
        # this sequence's may have too, and no more.
        self.ordered_moves = self.moves - (other.moves - other.ordered_moves)
        return held

    def _privatize(self, layer, heads: np.ndarray, cols: np.ndarray) -> None:
        """Give (layer, heads[i]) a private copy of its page at table column cols[i] where that page is
        shared; pages only this sequence holds stay. `layer`: one layer, or each entry's [n] (every
        layer's pages then copy in one batch)."""
        heads, cols = np.asarray(heads, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        layers = np.broadcast_to(np.asarray(layer, dtype=np.int64), heads.shape)
        pages = self.table[layers, heads, cols]
        shared = self.pool.refs[layers, pages] > 1
        if not shared.any():
            return
        order = np.argsort(layers[shared], kind="stable")  # allocate_flat hands pages out in layer order
        layers, heads, cols, old = (a[shared][order] for a in (layers, heads, cols, pages))
        new = self.pool.allocate_flat(np.bincount(layers, minlength=self.pool.num_layers))
        self.pool.copy_pages(layers, old, new)
        self.table[layers, heads, cols] = new
        self.pool.release(layers, old)
        touched = tuple(np.unique(np.stack([layers, heads]), axis=1))  # one move per (layer, head), however many pages
        self.moves[touched] += 1
        self.ordered_moves[touched] += 1
        self.shrinks += 1
        self._dirty_from = min(self._dirty_from, int(cols.min()))

    def bytes_per_layer(self) -> np.ndarray:
        return self.num_pages.sum(axis=1) * self.pool.page_bytes

    def bytes_per_head(self) -> np.ndarray:
        """[layers, kv_heads] bytes."""
        return self.num_pages * self.pool.page_bytes

    # ---- growth -----------------------------------------------------------------------------
    def reserve(self, num_tokens: int) -> torch.Tensor:
        """Make room for `num_tokens` new tokens in every (layer, head) and record their positions.

        Returns the flat slots [layers, kv_heads, num_tokens] (on the pool's device) where the
        layers must write their K/V. All-or-nothing: if the pool lacks pages, nothing changes.
        """
        ps = self.pool.page_size
        self._take_pages(num_tokens)  # all or nothing, decided alike on every rank

        # On the device: a long prefill reserves layers x heads x tokens slots (8M for 32K tokens of
        # an 8B model), which numpy on the host would build and then copy over.
        device = self.pool.device
        index = upload(self.lengths, device)[:, :, None] + torch.arange(num_tokens, device=device)
        slots = self.device_table().gather(2, index // ps) * ps + index % ps
        L, H = self.lengths.shape
        positions = torch.arange(self.next_position, self.next_position + num_tokens, device=self.pool.device)
        layer_base = torch.arange(L, device=self.pool.device)[:, None, None] * self.pool.positions[0].numel()
        flat_slots = (slots + layer_base).view(-1)
        self.pool.positions.view(-1).index_copy_(0, flat_slots, positions.repeat(L * H))
        self.pool.attention_mass.view(-1).index_fill_(0, flat_slots, 0.0)
        self.lengths += num_tokens
        self.next_position += num_tokens
        return slots

    def reserve_on_host(self, num_tokens: int) -> np.ndarray:
        """reserve() without any device work, for a decode step that uploads its metadata in one copy:
        returns the slots [layers, kv_heads, num_tokens] as numpy. The caller must write the tokens'
        positions and zero their attention mass in the pool (the CUDA-graph step does, on the device)."""
        self._take_pages(num_tokens)
        return self._append_on_host(num_tokens)

    def _append_on_host(self, num_tokens: int) -> np.ndarray:
        """Count `num_tokens` more tokens in every head, whose pages are placed: their slots [layers,
        kv_heads, num_tokens] (numpy)."""
        ps = self.pool.page_size
        index = self.lengths[:, :, None] + np.arange(num_tokens)
        L, H = self.lengths.shape
        pages = self.table[np.arange(L)[:, None, None], np.arange(H)[None, :, None], index // ps]
        self.lengths += num_tokens
        self.next_position += num_tokens
        return pages * ps + index % ps

    def _take_pages(self, num_tokens: int) -> None:
        """Allocate the pages `num_tokens` more tokens need, in every (layer, head); all or nothing, and
        decided alike on every rank of a tensor-parallel engine (PagePool.room, one call)."""
        plan = self._pages_for(num_tokens)
        counts = plan.counts(self.pool.num_layers)
        if not self.pool.room(counts[None]):
            raise self.pool.full_error(counts)
        self._grow(plan)

    def _pages_for(self, num_tokens: int, released: dict | None = None) -> _Growth:
        """What `num_tokens` more tokens in every (layer, head) take; changes nothing. released: in a
        batch of sequences planned before any grows, {layer * pool pages + page: holds the sequences
        planned so far give up} (their copies on write), which this one's plan adds to."""
        ps = self.pool.page_size
        needed = -(-(self.lengths + num_tokens) // ps) - self.num_pages
        if num_tokens <= 0:
            return _Growth(needed)
        # An append into a shared, partly filled last page writes into it: it is copied first.
        partial = (self.lengths % ps != 0) & (self.num_pages > 0)
        if not partial.any():
            return _Growth(needed)
        layers, heads = np.nonzero(partial)
        flat = layers * self.pool.num_pages + self.table[layers, heads, self.num_pages[layers, heads] - 1]
        refs = self.pool.refs.reshape(-1)[flat]
        if released:
            refs = refs - np.array([released.get(int(f), 0) for f in flat], dtype=refs.dtype)
        shared = refs > 1
        if not shared.any():
            return _Growth(needed)
        if released is not None:
            for f in flat[shared].tolist():
                released[f] = released.get(f, 0) + 1
        return _Growth(needed, layers[shared], heads[shared])

    def _grow(self, plan: _Growth) -> None:
        """Carry out a plan of _pages_for, whose pages `room` found: copy the shared last pages (every
        layer's in one batch; one that stopped being shared meanwhile stays), then place the new pages
        (none, in most decode steps: nothing changes then)."""
        if plan.cow_layers is None and not plan.needed.any():
            return
        if plan.cow_layers is not None:
            self._privatize(plan.cow_layers, plan.cow_heads, self.num_pages[plan.cow_layers, plan.cow_heads] - 1)
        self._place_pages(plan.needed, self.pool.allocate_flat(plan.needed.sum(axis=1)))

    def reserve_layout(self, lengths: np.ndarray, next_position: int) -> list[torch.Tensor]:
        """Give an empty sequence pages for lengths[layer, head] tokens each (heads may differ, as after
        eviction) and set its next position; the state tiers restore stored KV through this.

        Returns per layer the flat slots [sum over heads of lengths] in (head, token) order, where the
        caller writes K/V, positions and attention mass. All-or-nothing, like reserve()."""
        if self.next_position or self.lengths.any():
            raise ValueError("reserve_layout needs an empty sequence")
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != self.lengths.shape or (lengths < 0).any():
            raise ValueError(f"lengths must be non-negative, of shape {self.lengths.shape}")
        ps = self.pool.page_size
        needed = -(-lengths // ps)
        counts = needed.sum(axis=1)
        if not self.pool.room(counts[None]):  # decided alike on every rank (one call)
            raise self.pool.full_error(counts)
        self._place_pages(needed, self.pool.allocate_flat(counts))
        self.lengths = lengths.copy()
        self.moves += 1  # written behind the page statistics' back (a restore)
        self.next_position = int(next_position)
        return layer_slots(self.device_table(), lengths, ps)[0]

    def _place_pages(self, needed: np.ndarray, pages: np.ndarray) -> None:
        """Append `pages` (needed.sum() page ids in (layer, head) order) to the heads' tables:
        needed[layer, head] of them after the pages each head has."""
        new_total = self.num_pages + needed
        if new_total.max(initial=0) > self.table.shape[2]:
            grown = np.zeros((*self.table.shape[:2], max(2 * self.table.shape[2], int(new_total.max()))), np.int64)
            grown[:, :, : self.table.shape[2]] = self.table
            self.table = grown
            self._table_device = None
        first = self.num_pages
        uniform = ((needed == needed[:, :1]) & (first == first[:, :1])).all()
        if uniform:
            # Every head of a layer grows alike (no eviction yet): a block copy per layer. A 32K
            # prefill places 16K pages per layer, and the general scatter below would delay the
            # first kernel.
            H, start = self.pool.num_kv_heads, 0
            for layer in np.flatnonzero(needed[:, 0]):
                n, col = int(needed[layer, 0]), int(first[layer, 0])
                self.table[layer, :, col : col + n] = pages[start : start + H * n].reshape(H, n)
                self._dirty_from = min(self._dirty_from, col)
                start += H * n
        elif needed.any():
            # Uneven heads (a decode step crosses a page in a few of them): one scatter over all
            # layers; the device copy takes these cells alone (_appended_from).
            flat_needed = needed.reshape(-1)
            rows = np.repeat(np.arange(flat_needed.size), flat_needed)  # (layer, head) of each new page
            offsets = np.arange(len(rows)) - np.repeat(np.cumsum(flat_needed) - flat_needed, flat_needed)
            cols = first.reshape(-1)[rows] + offsets
            H = self.pool.num_kv_heads
            self.table[rows // H, rows % H, cols] = pages
            grew = needed > 0
            self._appended_from[grew] = np.minimum(self._appended_from[grew], first[grew])
        self.num_pages = new_total

    # ---- reads ------------------------------------------------------------------------------
    def device_table(self) -> torch.Tensor:
        """The page table [layers, kv_heads, capacity] on the pool's device."""
        appended_from, self._appended_from = self._appended_from, np.full_like(self._appended_from,
                                                                              np.iinfo(np.int64).max)
        if self.pool.device.type == "cpu":
            return torch.from_numpy(self.table)
        if self._table_device is None or self._table_device.shape != self.table.shape:
            self._table_device = upload(self.table, self.pool.device)  # pinned: no wait for the device
        else:
            # The copy may have been made under inference mode (inside a forward); updating it in
            # place is allowed only there. Columns past a head's pages are never read.
            lo, hi = self._dirty_from, int(self.num_pages.max(initial=0))
            with torch.inference_mode():
                if lo < hi:
                    tail = _staged(self.table[:, :, lo:hi], self.pool.device)
                    self._table_device[:, :, lo:hi].copy_(tail, non_blocking=True)
                self._upload_appended(appended_from)
        self._dirty_from = self.table.shape[2]
        return self._table_device

    def _upload_appended(self, appended_from: np.ndarray) -> None:
        """Copy to the device table the cells from appended_from[layer, head] to the head's last page
        (some may be in the columns copied whole just before: copied twice, the same)."""
        layer, head = np.nonzero(appended_from < self.num_pages)
        if not len(layer):
            return
        start = appended_from[layer, head]
        count = self.num_pages[layer, head] - start
        row = (layer * self.table.shape[1] + head) * self.table.shape[2]
        cells = np.repeat(row + start, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        staged = _staged(np.concatenate([cells, self.table.reshape(-1)[cells]]), self.pool.device)
        cells, pages = staged.to(self.pool.device, non_blocking=True).split(len(cells))
        self._table_device.view(-1).index_copy_(0, cells, pages)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [kv_heads, S, D] (in the compute dtype, dequantized from a quantized pool) and positions
        [kv_heads, S] of one layer, padded to S = max length. Entries past a head's length are padding."""
        S = int(self.lengths[layer].max(initial=0))
        table = self.device_table()[layer][None]
        k, v = (self.pool.gather(layer, table, S, kind)[0] for kind in ("k", "v"))
        return k, v, gather_pages(self.pool.positions[layer], table, S)[0]

    def gather_layers(self, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gather() of several layers in one pass: K, V [G, kv_heads, S, D] and positions [G, kv_heads,
        S] of `layers` (G of them), padded to S = their longest head."""
        ids, tables, S = self._layer_tables(layers)
        k, v = (self.pool.gather(ids, tables, S, kind) for kind in ("k", "v"))
        return k, v, gather_pages(*layer_pages(self.pool.positions, ids, tables), S)

    def gather_positions(self, layers: list[int]) -> torch.Tensor:
        """Positions [G, kv_heads, S] of `layers`, padded to S = their longest head, in one pass."""
        ids, tables, S = self._layer_tables(layers)
        return gather_pages(*layer_pages(self.pool.positions, ids, tables), S)

    def _layer_tables(self, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The layer ids [G] and page tables [G, kv_heads, capacity] of `layers` on the pool's device,
        and their longest head."""
        ids = torch.tensor(layers, dtype=torch.int64).to(self.pool.device)
        return ids, self.device_table()[ids], int(self.lengths[layers].max(initial=0))

    def held(self, layers: list[int], S: int, device: torch.device) -> torch.Tensor:
        """[G, kv_heads, S] bool: True where a head of `layers` holds a token (gathers pad past it)."""
        return torch.arange(S, device=device) < upload(self.lengths[layers], device)[..., None]

    def gather_attention_mass(self, layer: int) -> torch.Tensor:
        """[kv_heads, S] accumulated attention mass of the layer's tokens, padded like gather()."""
        S = int(self.lengths[layer].max(initial=0))
        return gather_pages(self.pool.attention_mass[layer], self.device_table()[layer][None], S)[0]

    def count_positions(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Per head, how many held tokens have a position in [lo, hi)."""
        pos = self.gather_positions([layer])
        return ((pos >= lo) & (pos < hi) & self.held([layer], pos.shape[-1], pos.device))[0].sum(dim=1).cpu().numpy()

    # ---- eviction and rollback (keep, keep_masks and drop_pages: turnkv/kv/compaction.py) --------
    def _shrink(self, layer: int, new_lengths: np.ndarray, moved: np.ndarray | None = None) -> None:
        self.shrinks += 1
        self.moves[layer] += (new_lengths < self.lengths[layer]) if moved is None else moved
        keep_pages = -(-new_lengths // self.pool.page_size)
        cols = np.arange(self.table.shape[2])
        gone = (cols >= keep_pages[:, None]) & (cols < self.num_pages[layer][:, None])  # [kv_heads, capacity]
        # One release for every head, heads last to first: the free stack ends as per-head releases leave it.
        self.pool.release(layer, self.table[layer, ::-1][gone[::-1]])
        self.num_pages[layer] = keep_pages
        self.lengths[layer] = new_lengths

    def truncate(self, num_positions: int) -> None:
        """Drop every token at position >= num_positions (a rollback: cheap, no data moves)."""
        if num_positions < 0:
            raise ValueError(f"cannot truncate to {num_positions} positions")
        if num_positions >= self.next_position:
            return
        layers = list(range(self.pool.num_layers))
        pos = self.gather_positions(layers)
        held = self.held(layers, pos.shape[-1], pos.device)
        for layer, counts in zip(layers, ((pos < num_positions) & held).sum(dim=-1).cpu().numpy()):
            self._cut(layer, counts.astype(np.int64))
        self.next_position = num_positions

    def unreserve(self, num_tokens: int) -> None:
        """Undo the last reserve of num_tokens, with nothing done to the sequence since: they are the
        last num_tokens slots of every head (a decode step launched ahead for a generation that turned
        out to have stopped). Unlike truncate, reads nothing from the device."""
        if num_tokens > int(self.lengths.min()) or num_tokens > self.next_position:
            raise ValueError(f"cannot unreserve {num_tokens} tokens from heads holding {int(self.lengths.min())}")
        for layer in range(self.pool.num_layers):
            self._cut(layer, self.lengths[layer] - num_tokens)
        self.next_position -= num_tokens

    def _cut(self, layer: int, new_lengths: np.ndarray) -> None:
        """_shrink to `new_lengths`, the heads' newest tokens going."""
        self.ordered_moves[layer] += new_lengths < self.lengths[layer]
        self._shrink(layer, new_lengths)

    def free(self) -> None:
        """Return every page to the pool: one release for all layers, each layer's pages in the order
        _shrink releases them (heads last to first), so the free stacks end as per-layer frees leave them."""
        cols = np.arange(self.table.shape[2])
        held = cols[None, None, :] < self.num_pages[:, :, None]  # [layers, kv_heads, capacity]
        layers = np.repeat(np.arange(self.pool.num_layers), held.sum(axis=(1, 2)))
        self.pool.release(layers, self.table[:, ::-1][held[:, ::-1]])
        self.shrinks += self.pool.num_layers
        self.moves += self.lengths > 0
        self.num_pages[:] = 0
        self.lengths[:] = 0
        self.next_position = 0


def _staged(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a host tensor a non-blocking copy to `device` may read: pinned for CUDA (a copy from
    pageable memory waits for every step in flight). PyTorch's pinned-memory cache keeps the block
    until the copy that reads it is done."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host.pin_memory() if device.type == "cuda" else host


@dataclass
class _Growth:
    """What a reserve takes (SequenceKV._pages_for): new pages [layers, kv_heads], and the (layer, head)
    pairs [n] whose shared last page is copied first (None: none)."""

    needed: np.ndarray
    cow_layers: np.ndarray | None = None
    cow_heads: np.ndarray | None = None

    def counts(self, num_layers: int) -> np.ndarray:
        """Pages per layer [layers], the copies included."""
        counts = self.needed.sum(axis=1)
        if self.cow_layers is not None:
            counts = counts + np.bincount(self.cow_layers, minlength=num_layers)
        return counts


def reserve_step_on_host(seqs: list[SequenceKV]) -> np.ndarray:
    """reserve_on_host(1) for every sequence of a decode step, with one PagePool.room for the step (one
    collective under tensor parallelism, not one per sequence): slots [B, layers, kv_heads, 1] (numpy).
    All or nothing: when a sequence cannot take its token, KVCacheFullError, at the same sequence on
    every rank, with no sequence's token reserved (those before it give theirs back: their positions
    were never written, so a truncate by position could not tell them from the tokens before)."""
    pool = seqs[0].pool
    released: dict = {}
    plans = [s._pages_for(1, released) for s in seqs]
    rows = np.stack([plan.counts(pool.num_layers) for plan in plans])  # [B, layers]
    fit = pool.room(rows)
    host = []
    for s, plan in zip(seqs[:fit], plans):
        s._grow(plan)
        host.append(s._append_on_host(1))
    if fit < len(seqs):
        error = pool.full_error(rows[fit])
        for s in seqs[:fit]:
            s.unreserve(1)
        raise error
    return np.stack(host)


def reserve_step(seqs: list[SequenceKV]) -> list[torch.Tensor]:
    """reserve(1) for every sequence of a decode step, the batch's slots uploaded in one copy: per
    sequence the slots [layers, kv_heads, 1] on the pool's device, with the tokens' positions written
    and their attention mass zeroed in the pool, as reserve() does. All or nothing, one PagePool.room
    deciding for the whole step (reserve_step_on_host)."""
    pool = seqs[0].pool
    host = reserve_step_on_host(seqs)  # [B, L, H, 1]
    B, L, H, _ = host.shape
    flat = host + np.arange(L)[None, :, None, None] * pool.positions[0].numel()
    positions = np.repeat(np.array([s.next_position - 1 for s in seqs], dtype=np.int64), L * H)
    staged = _staged(np.concatenate([host.reshape(-1), flat.reshape(-1), positions]), pool.device)
    slots, flat_slots, positions = staged.to(pool.device, non_blocking=True).split(B * L * H)
    pool.positions.view(-1).index_copy_(0, flat_slots, positions)
    pool.attention_mass.view(-1).index_fill_(0, flat_slots, 0.0)
    return list(slots.view(B, L, H, 1).unbind(0))
