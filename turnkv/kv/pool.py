"""The page pool under every conversation: per layer, fixed-size pages of K, V and token positions.

A page belongs to one (conversation, layer, kv_head) at a time, so heads can hold different numbers
of tokens and memory follows what each head keeps. Keys are stored after RoPE.
"""

from __future__ import annotations

import torch

from turnkv.errors import KVCacheFullError


class PagePool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_pages, page_size, head_dim)
        # Zeros, not empty: padded reads of never-written slots must stay finite (0 * NaN = NaN).
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.positions = torch.zeros(num_layers, num_pages, page_size, dtype=torch.int64, device=self.device)
        # Attention mass each stored token has received (H2O's heavy-hitter statistic), kept beside it.
        self.attention_mass = torch.zeros(num_layers, num_pages, page_size, dtype=torch.float32, device=self.device)
        # Stacks of free page ids per layer; popping from the end hands out low ids first.
        self._free = [list(range(num_pages - 1, -1, -1)) for _ in range(num_layers)]

    @classmethod
    def for_budget(cls, config, max_bytes: int, page_size: int, dtype: torch.dtype, device) -> PagePool:
        """A pool whose K/V pages take at most `max_bytes` in all."""
        element = torch.empty((), dtype=dtype).element_size()
        page_bytes = 2 * page_size * config.head_dim * element
        num_pages = max_bytes // (page_bytes * config.num_layers)
        if num_pages < config.num_kv_heads:
            raise KVCacheFullError(f"{max_bytes} bytes cannot hold one page per KV head")
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, int(num_pages), page_size, dtype, device)

    @property
    def page_bytes(self) -> int:
        """K and V bytes of one page."""
        return 2 * self.page_size * self.head_dim * self.k.element_size()

    def free_pages(self, layer: int) -> int:
        return len(self._free[layer])

    def used_pages(self, layer: int) -> int:
        return self.num_pages - len(self._free[layer])

    def bytes_in_use(self) -> int:
        return sum(self.used_pages(layer) for layer in range(self.num_layers)) * self.page_bytes

    def capacity_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    def allocate(self, counts: list[int]) -> list[list[int]]:
        """Take counts[layer] pages in every layer, or none at all when any layer lacks room."""
        short = [(layer, n, len(self._free[layer])) for layer, n in enumerate(counts) if n > len(self._free[layer])]
        if short:
            layer, n, free = short[0]
            raise KVCacheFullError(
                f"KV pool full: layer {layer} needs {n} pages and has {free} free "
                f"({self.num_pages} pages of {self.page_size} tokens per layer); free a conversation or "
                f"give the pool more memory"
            )
        taken = []
        for layer, n in enumerate(counts):
            free = self._free[layer]
            taken.append(free[len(free) - n:][::-1] if n else [])
            del free[len(free) - n:]
        return taken

    def release(self, layer: int, pages) -> None:
        self._free[layer].extend(int(p) for p in reversed(list(pages)))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows of K/V ([n, head_dim]) at flat slots (page * page_size + offset)."""
        self.k[layer].view(-1, self.head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, self.head_dim).index_copy_(0, slots, v)
