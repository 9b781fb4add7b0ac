"""The page pool under every conversation: per layer, fixed-size pages of K, V and token positions.

A page is written for one (conversation, layer, kv_head), so heads can hold different numbers of
tokens and memory follows what each head keeps. Keys are stored after RoPE. A page may then be held
by several holders at once (conversations that share a prefix, and the prefix index): `refs` counts
them, a page returns to the free stack when its count reaches zero, and the pool counts it once.
Holders never write into a page another holds (SequenceKV copies it first: copy on write).

K/V are stored in the compute dtype, or quantized (`kv_dtype` int8 or fp8 e4m3; turnkv/kv/quant.py):
narrow codes in `k`/`v` and one fp32 scale per slot (a token of a head) in `k_scale`/`v_scale`. Writes
take compute-dtype rows and quantize them. Readers outside the attention kernels go through `gather`,
`pages` and `rows`, which dequantize; the kernels get the codes and `scale_kwargs(layer)`.
"""

from __future__ import annotations

import numpy as np
import torch

from turnkv.attention.reference import gather_pages
from turnkv.errors import KVCacheFullError
from turnkv.kv import quant
from turnkv.model import ops
from turnkv.sizes import format_bytes
from turnkv.model.parallel import Shard


def layer_pages(per_page: torch.Tensor, layer: int | torch.Tensor,
                tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool tensor [layers, pages, ...] and page tables [B, H, P] of `layer` (an int, or [B]
    layers, one per table) -> the pages [n, ...] and tables into them that gather_pages reads."""
    if not isinstance(layer, torch.Tensor):
        return per_page[layer], tables
    return per_page.flatten(0, 1), tables + (layer * per_page.shape[1])[:, None, None]


class PagePool:
    # The tensor-parallel shard (turnkv/model/parallel.py) whose KV heads the pool holds, set by the
    # engine; None on one device. Layer-wide decisions over heads (an eviction's) gather across ranks.
    shard: Shard | None = None
    # Set by the engine under tensor parallelism (None on one device): agree(values) -> each of the
    # ints `values` at its largest over the ranks, a collective that waits for no device stream. Every
    # rank's pool holds its own KV heads, which may keep more tokens than another rank's (a head-wise
    # allocation), so `room` asks it: the ranks reserve alike or all raise KVCacheFullError.
    agree = None

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_dtype=None,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        # dtype: what writes take and reads return (the model's compute dtype); kv_dtype: what is stored.
        self.dtype, self.device = dtype, torch.device(device)
        self.kv_dtype_name = quant.kv_dtype_name(kv_dtype)
        self.quantized = self.kv_dtype_name != "none"
        self.kv_dtype = quant.storage_dtype(kv_dtype) if self.quantized else dtype
        shape = (num_layers, num_pages, page_size, head_dim)
        # Zeros, not empty: padded reads of never-written slots must stay finite (0 * NaN = NaN).
        self.k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(shape[:3], dtype=quant.SCALE_DTYPE, device=self.device)
            self.v_scale = torch.zeros(shape[:3], dtype=quant.SCALE_DTYPE, device=self.device)
        self.positions = torch.zeros(num_layers, num_pages, page_size, dtype=torch.int64, device=self.device)
        # Attention mass each stored token has received (H2O's heavy-hitter statistic), kept beside it.
        self.attention_mass = torch.zeros(num_layers, num_pages, page_size, dtype=torch.float32, device=self.device)
        # Stacks of free page ids per layer, top at _top[layer]; popping from the end hands out low
        # ids first. Arrays, not lists: a 32K-token prefill of an 8B model takes 16K pages per layer,
        # too many to hand out as Python ints without delaying the first kernel.
        self._stack = np.tile(np.arange(num_pages - 1, -1, -1, dtype=np.int64), (num_layers, 1))
        self._top = np.full(num_layers, num_pages, dtype=np.int64)
        # Holders of each page [layers, pages]: 0 free, 1 private, more shared.
        self.refs = np.zeros((num_layers, num_pages), dtype=np.int32)
        # A cache whose entries hold pages that nobody else may need (the prefix index), dropped
        # oldest first when an allocation lacks room: len(cache), cache.freed_by_drops() ->
        # [len + 1, layers] pages freed per layer by dropping its k oldest entries (k = 0..len, counted
        # without dropping any), cache.drop_oldest(k).
        self.cache = None

    @staticmethod
    def token_head_bytes(head_dim: int, dtype: torch.dtype, kv_dtype=None) -> int:
        """K and V bytes of one token of one KV head: the rows, plus their scales when quantized."""
        stored = kv_dtype if isinstance(kv_dtype, torch.dtype) else (quant.storage_dtype(kv_dtype) or dtype)
        scales = 2 * quant.SCALE_BYTES if quant.is_quantized(stored) else 0
        return 2 * head_dim * torch.empty((), dtype=stored).element_size() + scales

    @classmethod
    def smallest_budget(cls, config, page_size: int, dtype: torch.dtype, kv_dtype=None) -> int:
        """The fewest bytes for_budget takes: one page per KV head in every layer."""
        page_bytes = page_size * cls.token_head_bytes(config.head_dim, dtype, kv_dtype)
        return page_bytes * config.num_kv_heads * config.num_layers

    @classmethod
    def check_budget(cls, config, max_bytes: int, page_size: int, dtype: torch.dtype, kv_dtype=None) -> None:
        """KVCacheFullError naming the smallest budget when `max_bytes` cannot hold one page per KV head
        in every layer."""
        smallest = cls.smallest_budget(config, page_size, dtype, kv_dtype)
        if max_bytes < smallest:
            raise KVCacheFullError(f"a KV pool of {format_bytes(max_bytes)} cannot hold one page of {page_size} tokens "
                                   f"per KV head in every layer; this model needs at least {format_bytes(smallest)} "
                                   f"({smallest} bytes); give more with kv_memory= or --kv-memory")

    @classmethod
    def for_budget(cls, config, max_bytes: int, page_size: int, dtype: torch.dtype, device, kv_dtype=None) -> PagePool:
        """A pool whose K/V pages (and scales) take at most `max_bytes` in all."""
        cls.check_budget(config, max_bytes, page_size, dtype, kv_dtype)
        page_bytes = page_size * cls.token_head_bytes(config.head_dim, dtype, kv_dtype)
        num_pages = max_bytes // (page_bytes * config.num_layers)
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, int(num_pages), page_size, dtype, device,
                   kv_dtype)

    @property
    def token_bytes(self) -> int:
        """K and V bytes of one token of one KV head (scales included): what a read of it costs."""
        return self.token_head_bytes(self.head_dim, self.dtype, self.kv_dtype)

    @property
    def page_bytes(self) -> int:
        """K and V bytes of one page (scales included)."""
        return self.page_size * self.token_bytes

    @property
    def sequence_capacity(self) -> int:
        """The most tokens one sequence can hold, every page its own (all heads keep every token)."""
        return self.num_pages // self.num_kv_heads * self.page_size

    def free_pages(self, layer: int) -> int:
        return int(self._top[layer])

    def used_pages(self, layer: int) -> int:
        return self.num_pages - int(self._top[layer])

    def bytes_in_use(self) -> int:
        """Bytes of the pages in use; a shared page counts once."""
        return sum(self.used_pages(layer) for layer in range(self.num_layers)) * self.page_bytes

    def shared_bytes(self) -> int:
        """Bytes of the pages held by more than one holder, each counted once."""
        return int((self.refs > 1).sum()) * self.page_bytes

    def capacity_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    def allocate(self, counts) -> list[np.ndarray]:
        """Take counts[layer] pages in every layer (int64 arrays of page ids), or none at all when
        any layer lacks room."""
        counts = np.asarray(counts, dtype=np.int64)
        return np.split(self.allocate_flat(counts), np.cumsum(counts)[:-1])

    def allocate_flat(self, counts) -> np.ndarray:
        """allocate(), its page ids laid end to end in layer order. Decides from this rank's pool alone:
        callers that run in step on every rank of a tensor-parallel engine ask `room` first."""
        counts = np.asarray(counts, dtype=np.int64)
        if (counts > self._top).any():
            fit, drops = self._plan_room(counts[None])
            if drops:
                self.cache.drop_oldest(drops)
            if not fit:
                raise self.full_error(counts)
        # Each layer pops counts[layer] pages off its free stack, the top first: one gather for all.
        layers = np.repeat(np.arange(len(counts)), counts)
        depth = np.arange(len(layers)) - np.repeat(np.cumsum(counts) - counts, counts)
        pages = self._stack[layers, self._top[layers] - 1 - depth]
        self._top -= counts
        self.refs[layers, pages] = 1
        return pages

    def room(self, rows, most: int | None = None) -> int:
        """How many leading rows of rows [B, layers] (pages per layer of B allocations to be made one
        after another) fit, the same number on every rank of a tensor-parallel engine; most caps this
        rank's answer (a limit of its own besides the pages). Makes the room: the cache's oldest
        entries are dropped until they fit, every entry when some row does not (the same entries on
        every rank). Allocates nothing; allocations of the rows that fit then succeed. Under tensor
        parallelism a collective (`agree`): every rank calls it at the same point, with rows of the
        same B."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, self.num_layers)
        fit, drops = self._plan_room(rows)
        if most is not None:
            fit = min(fit, most)
        if self.agree is not None:
            least, drops = self.agree([-fit, drops])
            fit = -least
        if drops:
            self.cache.drop_oldest(drops)
        return fit

    def _plan_room(self, rows: np.ndarray) -> tuple[int, int]:
        """(how many leading rows [B, layers] fit in this pool, how many of the cache's oldest entries
        to drop first: as few as make them fit, or every one when a row does not). Changes nothing."""
        need = np.cumsum(rows, axis=0)  # [B, layers]: the pages taken once each row is
        over = (need > self._top).any(axis=1)
        if not over.any():
            return len(rows), 0
        if self.cache is None or not len(self.cache):
            return int(over.argmax()), 0
        freed = self.cache.freed_by_drops()  # [E + 1, layers]
        ok = (need[:, None, :] <= self._top + freed).all(axis=2)  # [B, E + 1]: row b fits after k drops
        fits = ok.any(axis=1)
        if not fits.all():
            return int(fits.argmin()), len(freed) - 1
        return len(rows), int(ok.argmax(axis=1).max())

    def full_error(self, counts) -> KVCacheFullError:
        """The error of an allocation of counts[layer] pages that does not fit (here, or on another rank)."""
        counts = np.asarray(counts, dtype=np.int64)
        short = np.flatnonzero(counts > self._top)
        if not len(short):
            return KVCacheFullError("KV pool full on another rank of the tensor-parallel engine (its KV heads keep "
                                    "more tokens); free a conversation or give the pool more memory")
        layer = int(short[0])
        return KVCacheFullError(
            f"KV pool full: layer {layer} needs {int(counts[layer])} pages and has {int(self._top[layer])} free "
            f"({self.num_pages} pages of {self.page_size} tokens per layer); free a conversation or "
            f"give the pool more memory"
        )

    def release(self, layer, pages) -> None:
        """One holder lets go of `pages` (distinct ids per layer, each held) of `layer` (one layer, or
        each page's); a page nobody holds any more goes back to its layer's free stack."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if not len(pages):
            return
        layers = np.broadcast_to(np.asarray(layer, dtype=np.int64), pages.shape)
        bad = self.refs[layers, pages] < 1
        if bad.any():
            raise ValueError(f"layer {int(layers[bad][0])}: releasing pages that are not in use")
        self.refs[layers, pages] -= 1
        gone = self.refs[layers, pages] == 0
        for one in np.unique(layers[gone]):
            freed = pages[gone & (layers == one)]
            top = self._top[one]
            self._stack[one, top : top + len(freed)] = freed[::-1]
            self._top[one] = top + len(freed)

    def share(self, layer, pages) -> None:
        """One more holder takes `pages` (distinct ids per layer, each in use) of `layer` (one layer,
        or each page's)."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        flat, refs = np.asarray(layer, dtype=np.int64) * self.num_pages + pages, self.refs.reshape(-1)
        counts = refs[flat]
        if (counts < 1).any():
            raise ValueError(f"layer {int(np.broadcast_to(layer, pages.shape)[counts < 1][0])}: sharing pages "
                             f"that are not in use")
        refs[flat] = counts + 1

    def copy_pages(self, layer, src, dst) -> None:
        """Copy whole pages src -> dst [n] of `layer` (one layer, or each page's [n]): K, V, their
        scales, positions and attention mass, in one copy per store whatever the layers."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        base = np.asarray(layer, dtype=np.int64) * self.num_pages  # pages flattened over (layer, page)
        index = torch.as_tensor(np.stack(np.broadcast_arrays(base + src, base + dst)), device=self.device)
        for store in (self.k, self.v, self.k_scale, self.v_scale, self.positions, self.attention_mass):
            if store is not None:
                raw = quant.raw(store) if store is self.k or store is self.v else store
                flat = raw.view(-1, *raw.shape[2:])
                flat.index_copy_(0, index[1], flat.index_select(0, index[0]))

    # ---- K/V data ---------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """Store rows of K/V ([n, head_dim], compute dtype) at flat slots (page * page_size + offset);
        a quantized pool quantizes them. With scales, k/v are stored codes (`export_rows`): copied as
        they are into a pool of the same kv_dtype, dequantized (and requantized) into any other."""
        D = self.head_dim
        if k_scale is not None:
            if self.quantized and k.dtype == self.kv_dtype:
                for store, scales, codes, s in ((self.k, self.k_scale, k, k_scale), (self.v, self.v_scale, v, v_scale)):
                    quant.raw(store[layer]).view(-1, D).index_copy_(0, slots, quant.raw(codes.to(self.device)))
                    scales[layer].view(-1).index_copy_(0, slots, s.to(self.device, quant.SCALE_DTYPE))
                return
            k, v = quant.dequantize(k, k_scale, self.dtype), quant.dequantize(v, v_scale, self.dtype)
        if not self.quantized:
            self.k[layer].view(-1, D).index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].view(-1, D).index_copy_(0, slots, v.to(self.dtype))
            return
        if _fused_quantize(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
            from turnkv.kv.quant_write import quantize_write

            quantize_write(k, v, slots, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer])
            return
        for store, scales, rows in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            codes, s = quant.quantize(rows, self.kv_dtype)
            quant.raw(store[layer]).view(-1, D).index_copy_(0, slots, quant.raw(codes))
            scales[layer].view(-1).index_copy_(0, slots, s)

    def write_heads(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write() for K/V as a decoder step makes them, [B, T, H, D], at slots [B * H * T] in
        (sequence, head, token) order. An unquantized pool on the kernels' device takes them in one
        launch without reordering them first (turnkv/kv/head_write.py); the rest goes through write()."""
        if not self.quantized and _fused_quantize(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
            from turnkv.kv.head_write import write_heads

            write_heads(k, v, slots, self.k[layer], self.v[layer])
            return
        D = self.head_dim
        self.write(layer, slots, k.transpose(1, 2).reshape(-1, D), v.transpose(1, 2).reshape(-1, D))

    def _store(self, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kind == "k":
            return self.k, self.k_scale
        if kind == "v":
            return self.v, self.v_scale
        raise ValueError(f"kind is 'k' or 'v', not {kind!r}")

    def gather(self, layer: int | torch.Tensor, tables: torch.Tensor, length: int, kind: str = "k") -> torch.Tensor:
        """K (or V) rows for page tables [B, H, P] -> [B, H, length, D] in the compute dtype
        (dequantized after the gather: the gather reads the narrow codes). layer: one layer for every
        table, or [B] int64 on the pool's device, the layer of each (several layers in one gather)."""
        store, scales = self._store(kind)
        rows = gather_pages(*layer_pages(store, layer, tables), length)
        if scales is None:
            return rows
        return quant.dequantize(rows, gather_pages(*layer_pages(scales, layer, tables), length), self.dtype)

    def pages(self, layer: int, pages: torch.Tensor, kind: str = "k") -> torch.Tensor:
        """Whole pool pages [n] of a layer -> [n, page_size, D] in the compute dtype."""
        store, scales = self._store(kind)
        rows = store[layer].index_select(0, pages)
        return rows if scales is None else quant.dequantize(rows, scales[layer].index_select(0, pages), self.dtype)

    def rows(self, layer: int, slots: torch.Tensor, kind: str = "k") -> torch.Tensor:
        """Rows at flat slots [n] of a layer -> [n, D] in the compute dtype."""
        store, scales = self._store(kind)
        rows = store[layer].view(-1, self.head_dim).index_select(0, slots)
        return rows if scales is None else quant.dequantize(rows, scales[layer].view(-1).index_select(0, slots), self.dtype)

    def export_rows(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored form of the rows at flat slots [n]: {"k", "v"} [n, D], and for a quantized pool
        the codes with their scales {"k_scale", "v_scale"} [n]. `write(..., **rows)` puts them back
        bit for bit."""
        D = self.head_dim
        out = {}
        for kind in ("k", "v"):
            store, scales = self._store(kind)
            out[kind] = store[layer].view(-1, D).index_select(0, slots)
            if scales is not None:
                out[f"{kind}_scale"] = scales[layer].view(-1).index_select(0, slots)
        return out

    def move(self, layer: int | torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every per-slot tensor (K, V, their scales, positions, attention mass) from flat slots
        src to dst [n] within a layer (eviction's compaction); overlapping lists are safe. layer: one
        layer, or [n] int64 on the pool's device, each slot pair's layer (every layer in one pass)."""
        D = self.head_dim
        offset = layer * (self.num_pages * self.page_size)  # slots of the layers before it
        src, dst = src + offset, dst + offset
        for store in (self.k, self.v):
            flat = quant.raw(store).view(-1, D)
            flat.index_copy_(0, dst, flat.index_select(0, src))  # index_select copies first: safe overlap
        for per_slot in (self.k_scale, self.v_scale, self.positions, self.attention_mass):
            if per_slot is not None:
                flat = per_slot.view(-1)
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def scale_kwargs(self, layer: int, slots: bool = False) -> dict[str, torch.Tensor]:
        """The arguments the indexed decode takes besides a quantized pool's codes: its scales, shaped
        like the codes without head_dim ([pages, page_size], or [slots, 1] for slot lists). Empty
        for a pool in the compute dtype."""
        if not self.quantized:
            return {}
        if slots:
            return {"k_scale": self.k_scale[layer].view(-1, 1), "v_scale": self.v_scale[layer].view(-1, 1)}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] as this pool would give it back after a write (itself when not quantized)."""
        return quant.round_trip(x, self.kv_dtype) if self.quantized else x


def _fused_quantize(rows: torch.Tensor) -> bool:
    """Whether a write takes a one-launch Triton kernel (turnkv/kv/quant_write.py, head_write.py): where
    the decoder's fused ops run (CUDA, or forced for tests; see turnkv/model/ops.py)."""
    return ops.use_kernels(rows)
