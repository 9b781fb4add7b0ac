"""Eviction's compaction of a SequenceKV: keep a chosen subset of each head's tokens, in order, and
give the pages that empties back to the pool (SequenceKV's `keep` and `keep_masks`), or drop whole
pages from inside heads' lists (`drop_pages`)."""

from __future__ import annotations

import numpy as np
import torch

# Tokens one PagePool.move copies at most: its gathered rows are a transient copy (256 MiB of K at
# 128 bf16 dims), however many tokens an eviction of every layer moves.
MOVE_SLOTS = 1 << 20


class Compaction:
    """SequenceKV's methods that drop tokens from inside heads' lists. They use its pool, lengths,
    table, num_pages, moves, table_edits, edited_from and _dirty_from, and its _privatize,
    _layer_tables, held and _shrink."""

    def keep(self, layer: int, keep: list) -> None:
        """Keep, per KV head of `layer`, the tokens at the given indices (into its current order) and
        drop the rest: keep_masks with those entries set. The indices must be integers, unique and
        within each head's length (ValueError otherwise, with nothing changed)."""
        H = self.pool.num_kv_heads
        if len(keep) != H:
            raise ValueError(f"keep needs one index tensor per KV head ({H}), got {len(keep)}")
        device = self.pool.device
        idx = [torch.as_tensor(i, device=device) for i in keep]
        for head, i in enumerate(idx):
            if i.numel() and (i.is_floating_point() or i.is_complex()):
                raise ValueError(f"layer {layer} head {head}: keep indices must be integers, got {i.dtype}")
        sizes = torch.tensor([i.numel() for i in idx])
        flat = torch.cat([i.reshape(-1).to(torch.int64) for i in idx])
        heads = torch.repeat_interleave(torch.arange(H, device=device), sizes.to(device))
        lengths = torch.from_numpy(self.lengths[layer]).to(device)
        outside = (flat < 0) | (flat >= lengths[heads])
        if flat.numel() and bool(outside.any()):
            head = int(heads[outside.nonzero()[0, 0]])
            raise ValueError(f"layer {layer} head {head}: keep indices must be in "
                             f"[0, {self.lengths[layer, head]})")
        mask = torch.zeros(H, int(self.lengths[layer].max(initial=0)), dtype=torch.bool, device=device)
        mask[heads, flat] = True
        self.keep_masks([layer], mask[None], expected=sizes.numpy()[None])

    def keep_masks(self, layers: list[int], mask: torch.Tensor, expected: np.ndarray | None = None,
                   lockstep: bool = False) -> None:
        """Keep, per KV head of each of `layers` (G distinct ones), the tokens where mask [G, kv_heads, S]
        (S at least their longest head; on the pool's device) is True; drop the rest. Kept tokens are
        compacted, in order, into the head's first pages; emptied pages go back to the pool. Needs no
        new page; a bad mask raises ValueError with nothing changed. Reads [3, G, kv_heads] integers
        back once and moves every layer's kept tokens in one PagePool.move per MOVE_SLOTS tokens.
        expected: [G, kv_heads] kept counts the caller asked for. Pages shared with another holder
        that the compaction writes are copied first (KVCacheFullError, with nothing changed, when the
        pool has no room for the copies). lockstep: every rank of a tensor-parallel engine makes this
        call at this point with the same layers (an eviction's), so the room for the copies is decided
        alike on every rank (PagePool.room, one call); without it, from this rank's pool alone."""
        H, ps = self.pool.num_kv_heads, self.pool.page_size
        G, S = len(layers), int(mask.shape[-1]) if mask.dim() == 3 else -1
        if mask.dtype != torch.bool or tuple(mask.shape[:2]) != (G, H) or S < self.lengths[layers].max(initial=0) \
                or len(set(layers)) != G:
            raise ValueError(f"keep_masks needs distinct layers and a bool mask of shape ({G}, {H}, S >= the "
                             f"longest head), got {mask.dtype} {tuple(mask.shape)} for layers {list(layers)}")
        if S == 0:  # nothing held: nothing to move
            mask = torch.zeros(G, H, 1, dtype=torch.bool, device=mask.device)
        lengths = torch.from_numpy(self.lengths[layers]).to(mask.device)
        valid = self.held(layers, mask.shape[-1], mask.device)
        dropped = valid & ~mask
        # A head's tokens before its first dropped one stay where they are; the kept ones after it move.
        first_drop = torch.where(dropped.any(dim=-1), dropped.to(torch.int8).argmax(dim=-1), lengths)
        outside = (mask & ~valid).sum(dim=-1)
        counts, first_drop, outside = torch.stack([mask.sum(dim=-1), first_drop, outside]).cpu().numpy()
        if outside.any():
            g, head = (int(i[0]) for i in np.nonzero(outside))
            raise ValueError(f"layer {layers[g]} head {head}: keep_masks marks tokens past the head's "
                             f"{self.lengths[layers[g], head]}")
        if expected is not None and (counts != expected).any():
            g, head = (int(i[0]) for i in np.nonzero(counts != expected))
            raise ValueError(f"layer {layers[g]} head {head}: keep indices must be unique")
        moved = counts > first_drop
        self._privatize_for_keep(layers, counts, first_drop, moved, lockstep)
        if moved.any():
            rank = mask.cumsum(dim=-1) - 1  # each kept token's index after compaction
            g, heads, src = (mask & (rank != torch.arange(S, device=mask.device))).nonzero(as_tuple=True)
            dst = rank[g, heads, src]
            ids, tables, _ = self._layer_tables(layers)
            src_slots, dst_slots = (tables[g, heads, i // ps] * ps + i % ps for i in (src, dst))
            # K, V (with a quantized pool's scales), positions and attention mass move together, in
            # chunks of ascending tokens: a kept token only moves to a lower index of its own head, so
            # no chunk writes a slot that a later chunk reads.
            for lo in range(0, len(g), MOVE_SLOTS):
                hi = lo + MOVE_SLOTS
                self.pool.move(ids[g[lo:hi]], src_slots[lo:hi], dst_slots[lo:hi])
        for g, layer in enumerate(layers):
            self._shrink(layer, counts[g].astype(np.int64), moved[g])

    def drop_pages(self, layers, heads, first, count) -> None:
        """Drop whole pages from inside heads' lists: for each (layers[i], heads[i]), the `count[i]`
        pages at table columns [first[i], first[i] + count[i]) go back to the pool and the columns
        after them shift left. Arguments broadcast (ints or arrays). The dropped pages must be full
        (their tokens are the head's indices [first * page_size, (first + count) * page_size)): the
        rest keeps its order, so positions still ascend. No K/V data moves; no device work.

        This is how streaming heads trim their window (a sink, then a ring of recent pages): the
        oldest pages of the ring go. Everything is checked before anything changes."""
        ls, hs, fs, cs = (a.astype(np.int64).ravel() for a in np.broadcast_arrays(layers, heads, first, count))
        L, H = self.lengths.shape
        ps = self.pool.page_size
        if ((ls < 0) | (ls >= L) | (hs < 0) | (hs >= H)).any():
            raise ValueError(f"drop_pages: layers must be in [0, {L}) and heads in [0, {H})")
        if len(set(zip(ls.tolist(), hs.tolist()))) != len(ls):
            raise ValueError("drop_pages: each (layer, head) at most once per call")
        if ((fs < 0) | (cs < 0) | ((fs + cs) * ps > self.lengths[ls, hs])).any():
            raise ValueError("drop_pages: pages to drop must be whole pages within each head's list")
        todo = cs > 0
        ls, hs, fs, cs = ls[todo], hs[todo], fs[todo], cs[todo]
        if not len(ls):
            return
        num_pages = self.num_pages[ls, hs]
        # Vectorised per distinct (first, count) (streaming heads share one): gather what goes, then
        # shift the columns after it left, up to the longest of these heads' tables.
        for f, c in set(zip(fs.tolist(), cs.tolist())):
            sel = (fs == f) & (cs == c)
            l, h = ls[sel], hs[sel]
            width = int(num_pages[sel].max())
            dropped = self.table[l, h, f : f + c]  # [n, c] (advanced indexing copies)
            self.table[l, h, f : width - c] = self.table[l, h, f + c : width]
            # One release for every layer: each layer's pages go back in the order a release per
            # layer would give them (its heads in order, each head's pages in table order).
            self.pool.release(np.repeat(l, c), dropped.ravel())
        self.num_pages[ls, hs] -= cs
        self.lengths[ls, hs] -= cs * ps
        self.moves[ls, hs] += 1
        self.table_edits[ls, hs] += 1
        self.edited_from[ls, hs] = np.minimum(self.edited_from[ls, hs], fs)
        self._dirty_from = min(self._dirty_from, int(fs.min()))

    def _privatize_for_keep(self, layers: list[int], counts: np.ndarray, first_drop: np.ndarray,
                            moved: np.ndarray, lockstep: bool) -> None:
        """Before keep_masks compacts: per head of each of `layers`, the pages its compaction writes
        (from its first dropped token's page to the last page it keeps) become private copies where
        they are shared. counts, first_drop, moved: [G, kv_heads]. All or nothing; with lockstep the
        room is agreed across ranks (PagePool.room), whether or not this rank copies any page."""
        ps = self.pool.page_size
        found = []  # (layers, heads, table columns) of the shared pages to copy
        for g, layer in enumerate(layers):
            if not moved[g].any():
                continue
            held = np.arange(self.table.shape[2])[None, :] < self.num_pages[layer][:, None]
            if not (self.pool.refs[layer, self.table[layer][held]] > 1).any():
                continue
            heads = np.flatnonzero(moved[g])
            spans = [np.arange(first_drop[g][h] // ps, -(-counts[g][h] // ps)) for h in heads]
            heads, cols = np.repeat(heads, [len(c) for c in spans]), np.concatenate(spans).astype(np.int64)
            shared = self.pool.refs[layer, self.table[layer, heads, cols]] > 1
            found.append((np.full(int(shared.sum()), layer, dtype=np.int64), heads[shared], cols[shared]))
        cow_layers, heads, cols = (np.concatenate(a) for a in zip(*found)) if found else (np.zeros(0, np.int64),) * 3
        if lockstep:
            pages = np.bincount(cow_layers, minlength=self.pool.num_layers)
            if not self.pool.room(pages[None]):
                raise self.pool.full_error(pages)
        if len(cow_layers):
            self._privatize(cow_layers, heads, cols)
