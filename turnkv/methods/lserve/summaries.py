"""Per logical page (16 tokens) and channel, the min and max of the post-RoPE keys, kept beside the
pool's pages: what the page selector scores instead of reading the keys (Quest, LServe).

Stats live per pool page ([layers, pool pages, page_size // logical_page, D]), so they follow a
page wherever the sequence tables put it and cost nothing to look up per conversation. Pool pages
must hold whole logical pages (page_size % logical_page == 0): with the default 16-token pool page,
one logical page per pool page.

Kept current by `update` on every K write (the engine calls it right after PagePool.write with the
same slots), which resets a logical page when its first token is written; `update_runs` is the same
for a step's keys as the decoder makes them ([B, T, H, D], read in place: a Triton kernel on CUDA). Tokens are appended in
order, so a page's first token always comes before the others. After anything that moves or drops
tokens (SequenceKV.keep, truncate, a restore from the state tiers) call `rebuild_sequence`.

The statistics stay in the compute dtype over a quantized pool (int8 / fp8 KV): `update` folds the
compute-dtype keys handed to it at the write (pre-quantization, as LServe's), and only a rebuild,
after tokens moved or came back from a tier, reads the pool's keys back, dequantized.
"""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention import decode
from turnkv.attention.triton import available
from turnkv.gpu import upload
from turnkv.kv.pool import PagePool

# update_runs folds with the Triton kernel (attention/triton/page_fold.py) on CUDA; FORCE = True also
# runs it off CUDA (Triton's interpreter, for tests).
FORCE = False


def runs_kernel(device: torch.device) -> bool:
    return (device.type == "cuda" or FORCE) and available()


class PageSummaries:
    def __init__(self, pool: PagePool, logical_page: int = 16):
        if logical_page < 1 or pool.page_size % logical_page:
            raise ValueError(f"pool pages of {pool.page_size} tokens must hold whole logical pages of "
                             f"{logical_page}; use a pool page size that is a multiple of {logical_page}")
        self.pool, self.logical_page = pool, logical_page
        self.per_page = pool.page_size // logical_page
        rows = pool.num_pages * self.per_page
        # One scratch row past the end takes the resets of writes that start no page, so update()
        # needs no boolean indexing (no host sync on a GPU).
        shape = (pool.num_layers, rows + 1, pool.head_dim)
        self.kmax = torch.full(shape, float("-inf"), dtype=pool.dtype, device=pool.device)
        self.kmin = torch.full(shape, float("inf"), dtype=pool.dtype, device=pool.device)
        self._scratch = rows
        self._head_index: dict[tuple[int, ...], torch.Tensor] = {}  # update_runs' heads, on the device

    def bytes(self) -> int:
        return 2 * self.kmax[:, :-1].numel() * self.kmax.element_size()

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Fold keys k [n, D] written at flat pool slots [n] (page * page_size + offset), in write order."""
        rows = slots // self.logical_page
        starts = (slots % self.logical_page) == 0
        reset = torch.where(starts, rows, torch.full_like(rows, self._scratch))
        kmax, kmin = self.kmax[layer], self.kmin[layer]
        kmax.index_fill_(0, reset, float("-inf"))
        kmin.index_fill_(0, reset, float("inf"))
        index = rows[:, None].expand(-1, k.shape[1])
        kmax.scatter_reduce_(0, index, k.to(kmax.dtype), "amax", include_self=True)
        kmin.scatter_reduce_(0, index, k.to(kmin.dtype), "amin", include_self=True)

    def update_runs(self, layer: int, slots: torch.Tensor, k: torch.Tensor, heads=None) -> None:
        """update() for a step's keys as the decoder makes them: k [B, T, H, D] (any strides), written
        at slots [B, H, T] (or flat, in (sequence, head, token) order), each (sequence, head) its T
        tokens in order (SequenceKV.reserve's slots: they fill the head's pages in order). heads: the
        KV heads to fold, a sequence of ints or an int tensor on the pool's device (None: all).

        Bit for bit update() over those heads' slots and keys, bar its scratch row. On the kernel's
        devices one launch reads the keys in place (attention/triton/page_fold.py; keys in the
        statistics' dtype, the engine's case, or a narrower one fp32 holds); elsewhere the heads'
        keys are copied out in (sequence, head, token) order for update()."""
        B, T, H, D = k.shape
        slots = slots.view(B, H, T)
        index = None if heads is None else self._heads(heads)
        if runs_kernel(k.device):
            from turnkv.attention.triton import page_fold

            if page_fold.takes(k.dtype, self.kmax.dtype):
                page_fold.fold_runs(k, slots, self.kmax[layer], self.kmin[layer], self.logical_page, index)
                return
        if index is not None:
            slots, k = slots.index_select(1, index), k.index_select(2, index)
        self.update(layer, slots.reshape(-1), k.transpose(1, 2).reshape(-1, D))

    def _heads(self, heads) -> torch.Tensor:
        if isinstance(heads, torch.Tensor):
            return heads.to(self.pool.device, torch.int64)
        key = tuple(int(h) for h in heads)
        if key not in self._head_index:  # a device copy once per head set, not a host copy per call
            self._head_index[key] = torch.tensor(key, dtype=torch.int64, device=self.pool.device)
        return self._head_index[key]

    def fold(self, slots: torch.Tensor) -> None:
        """update() for a decode step of every layer at once, the keys read back from the pool: slots
        [L, n] are the flat slots each row wrote (one token per row). The Triton kernel on CUDA (one
        launch, capturable in a CUDA graph), fold_reference elsewhere. A selection reads no page
        from the newest on, so folding at the end of the step instead of at each layer's write gives
        the scores the same statistics."""
        if decode.uses_kernel(self.pool.device) and not self.pool.quantized:  # the kernel reads raw keys
            from turnkv.attention.triton import page_select

            page_select.fold_keys(self.pool.k, slots, self.kmax, self.kmin, self.logical_page)
        else:
            self.fold_reference(slots)

    def fold_reference(self, slots: torch.Tensor) -> None:
        for layer in range(slots.shape[0]):
            self.update(layer, slots[layer], self.pool.rows(layer, slots[layer], "k"))

    def rebuild(self, layer: int, pages: torch.Tensor, counts: torch.Tensor) -> None:
        """Recompute the stats of pool `pages` [n] from the pool's keys; page i holds counts[i] tokens."""
        ps, lp, D = self.pool.page_size, self.logical_page, self.pool.head_dim
        if len(pages) == 0:
            return
        # Host arrays go up through pinned memory: a pageable copy would wait for the forward this
        # runs inside (a restored conversation's first step rebuilds every layer).
        pages = upload(torch.as_tensor(pages, dtype=torch.int64), self.pool.device)
        counts = upload(torch.as_tensor(counts, dtype=torch.int64), self.pool.device)
        keys = self.pool.pages(layer, pages, "k").to(self.kmax.dtype)  # [n, ps, D]
        valid = (torch.arange(ps, device=pages.device) < counts[:, None])[..., None]
        shape = (len(pages), self.per_page, lp, D)
        kmax = keys.masked_fill(~valid, float("-inf")).view(shape).amax(2)
        kmin = keys.masked_fill(~valid, float("inf")).view(shape).amin(2)
        rows = (pages[:, None] * self.per_page + torch.arange(self.per_page, device=pages.device)).reshape(-1)
        self.kmax[layer].index_copy_(0, rows, kmax.reshape(-1, D))
        self.kmin[layer].index_copy_(0, rows, kmin.reshape(-1, D))

    def rebuild_sequence(self, seq, layers=None) -> None:
        """Recompute every page a SequenceKV holds (after keep / truncate / restore)."""
        for layer in (range(self.pool.num_layers) if layers is None else layers):
            self.rebuild_heads(seq, layer, np.arange(self.pool.num_kv_heads))

    def rebuild_heads(self, seq, layer: int, heads) -> None:
        """Recompute the pages of some KV heads of one layer of a SequenceKV (the heads that moved)."""
        ps = self.pool.page_size
        heads = np.asarray(heads, dtype=np.int64)
        num_pages, lengths = seq.num_pages[layer][heads], seq.lengths[layer][heads]
        owner = np.repeat(np.arange(len(heads)), num_pages)
        index = np.arange(owner.size) - np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
        pages = seq.table[layer, heads[owner], index]
        counts = np.clip(lengths[owner] - index * ps, 0, ps)
        self.rebuild(layer, torch.from_numpy(pages), torch.from_numpy(counts))

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stats of the pages in tables [B, H, P] -> kmax, kmin [B, H, P * per_page, D], in table order
        (logical page j of a head covers its tokens [16 j, 16 j + 16))."""
        B, H, P = tables.shape
        rows = tables.long()[..., None] * self.per_page + torch.arange(self.per_page, device=tables.device)
        rows = rows.reshape(-1)
        shape = (B, H, P * self.per_page, self.pool.head_dim)
        return (self.kmax[layer].index_select(0, rows).view(shape),
                self.kmin[layer].index_select(0, rows).view(shape))
