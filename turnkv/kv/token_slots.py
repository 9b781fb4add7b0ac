"""Flat pool slots of a sequence's tokens, per layer in (head, token) order: what the state tiers copy
out of the pages and back in. Made on the pool's device without waiting for it: the sizes are known on
the host, so repeat_interleave is given its output size (without it, it reads the counts back, a
synchronization per call), and the counts go up through pinned memory (gpu.upload). A 32K-token
history of an 8B model has millions of slots, too many to build on the host and copy over."""

from __future__ import annotations

import numpy as np
import torch

from turnkv.gpu import upload


def token_runs(lengths: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """lengths [R] tokens per run -> (the run of each token, its index within its run), [sum] int64
    each, on `device`, in run order."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    device = torch.device("cpu") if device is None else torch.device(device)
    total = int(lengths.sum())
    counts = upload(lengths, device)
    run = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    return run, torch.arange(total, device=device) - starts[run]


def layer_slots(table: torch.Tensor, lengths: np.ndarray, page_size: int,
                layers=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer of `layers` (default all): the flat slots of its tokens in (head, token) order and
    each token's index within its head (its position when nothing was evicted). table [L, H, P]:
    the sequence's page table on the pool's device; lengths [L, H]: tokens per (layer, head)."""
    L, H = lengths.shape
    layers = list(range(L)) if layers is None else [int(x) for x in layers]
    chosen = lengths[layers]
    run, index = token_runs(chosen, table.device)
    layer_of_run = upload(np.repeat(np.asarray(layers, dtype=np.int64), H), table.device)
    slots = table[layer_of_run[run], run % H, index // page_size] * page_size + index % page_size
    sizes = chosen.sum(axis=1).tolist()
    return list(slots.split(sizes)), list(index.split(sizes))
