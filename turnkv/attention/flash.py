"""FlashAttention-4 (the optional `flash-attn-4` package, CuTe-DSL kernels for Hopper and Blackwell) for
prefill chunks: a fresh chunk causal over itself, and a chunk over its kept history read from the page
pool in place.

Contracts (the same as the paths they stand in for):
- causal(q, k, v): reference.causal_prefill; q [B, Hq, T, D] and k, v [B, H, T, D], each a transposed
  view of a [B, T, heads, D] tensor with a contiguous last dim (what the step holds) -> [B, Hq, T, D],
  a view of a [B, T, Hq, D] tensor.
- paged(q, k_cache, v_cache, table, lengths): reference.paged_chunk without window, sink or scales:
  every head's last T entries are the chunk, causal from the bottom right; heads may hold different
  numbers of entries. Each (sequence, KV head) is one FA4 batch entry with its own page table and
  length, its query group as its heads.
- gathered(..., max_length): paged()'s contract, the heads' pages copied into contiguous runs first.

Switch: used on CUDA devices of compute capability 9.x and 10.x, in fp16 / bf16, for head dims FA4
takes, when flash_attn.cute imports. TURNKV_FLASH_ATTN=0 in the environment (read at import) or
`flash.ENABLED = False` turns it off; `flash.FORCE = True` also uses it off CUDA (tests, with a stand-in
for the package). FA4 compiles each kernel variant once (seconds), never per length. turnkv switches on
its disk cache of compiled kernels (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, unless the environment
sets it), as Triton keeps its own: only the first process on a machine pays the compile.

Which chunks it takes: each FA4 call costs about 0.2 ms of host time and has no key splits on Hopper,
so only chunks with work enough (takes_chunk, takes_fresh; long ones gathered, takes_gathered); the rest
stay on the paged Triton kernel and torch's SDPA (benchmarks/prefill/README.md has the measurements
behind the thresholds).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from turnkv.gpu import num_sms

ENABLED = os.environ.get("TURNKV_FLASH_ATTN", "1") != "0"
FORCE = False
# A chunk over history: query tiles of TILE_ROWS rows (a KV head's group folded in) at least
# MIN_TILES_PER_SM per SM, and new tokens x kept entries at least MIN_CELLS.
TILE_ROWS = 128
MIN_TILES_PER_SM = 0.7
MIN_CELLS = 1 << 24
# A fresh chunk: at least this many new tokens.
FRESH_MIN_ROWS = 4096
# A chunk over history of at least this many new tokens reads its heads' pages gathered into contiguous
# runs (gathered) rather than in place (paged): FA4's dense loads outrun its 16-token paged ones by more
# than the copy costs.
GATHER_MIN_ROWS = 1024


@functools.cache
def _interface():
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # read when the package loads
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # not installed, or its CUDA libraries do not load
        return None
    return flash_attn_func, flash_attn_varlen_func


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_properties(index).major in (9, 10)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FA4 runs attention for tensors of this device, dtype and head dim."""
    on_device = FORCE or (device.type == "cuda" and _device_ok(device.index or 0))
    return (ENABLED and on_device and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and 8 <= head_dim <= 256 and _interface() is not None)


def takes_chunk(device: torch.device, batch_kv_heads: int, group: int, num_new: int, max_length: int) -> bool:
    """Whether a chunk of num_new tokens over heads of at most max_length entries (the chunk included),
    its query groups of `group` heads, has work enough for FA4: tiles to fill the GPU without key
    splits, and cells enough to pay for the call's host time."""
    tiles = batch_kv_heads * -(-group * num_new // TILE_ROWS)
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    return tiles >= MIN_TILES_PER_SM * sms and num_new * max_length >= MIN_CELLS


def takes_gathered(num_new: int) -> bool:
    """Whether a chunk of num_new tokens that takes_chunk gives FA4 reads its history gathered."""
    return num_new >= GATHER_MIN_ROWS


def takes_fresh(num_new: int) -> bool:
    """Whether a fresh chunk of num_new tokens has work enough for FA4."""
    return num_new >= FRESH_MIN_ROWS


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a fresh chunk (the module's docstring gives the layouts)."""
    flash_attn_func = _interface()[0]
    out, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                             causal=True)
    return out.transpose(1, 2)


def _grouped(q: torch.Tensor, H: int) -> torch.Tensor:
    """q [B, Hq, T, D] -> [B * H, T, G, D], one FA4 batch entry per (sequence, KV head), its query group
    as heads: a strided view for one sequence, a copy for several."""
    B, Hq, T, D = q.shape
    grouped = q.reshape(B, H, Hq // H, T, D).transpose(2, 3)
    return grouped[0] if B == 1 else grouped.reshape(B * H, T, Hq // H, D)


def _ungrouped(out: torch.Tensor, B: int) -> torch.Tensor:
    """FA4's out [B * H, T, G, D] -> [B, Hq, T, D], a view of a [B, T, Hq, D] tensor."""
    BH, T, G, D = out.shape
    H = BH // B
    return out.view(B, H, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, H * G, D).transpose(1, 2)


def paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
          lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] over one layer's pool k_cache, v_cache [pages, PAGE, D] through table [B, H, P]
    and lengths [B, H] -> [B, Hq, T, D], a view of a [B, T, Hq, D] tensor."""
    flash_attn_varlen_func = _interface()[1]
    B, H = table.shape[:2]
    out, _ = flash_attn_varlen_func(  # (out, log-sum-exp)
        _grouped(q, H), k_cache[:, :, None], v_cache[:, :, None], seqused_k=lengths.reshape(B * H).to(torch.int32),
        page_table=table.reshape(B * H, -1).to(torch.int32), softmax_scale=scale, causal=True)
    return _ungrouped(out, B)


def gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
             lengths: torch.Tensor, max_length: int, scale: float | None = None) -> torch.Tensor:
    """paged()'s contract, with every head's pages first gathered into one contiguous run: FA4 then
    loads K/V as dense tiles (its TMA path), which its 16-token paged loads do not. max_length: the
    longest head's entries, known on the host (no device read). The copy reads and writes the kept
    K/V once, so it pays for long chunks only (takes_gathered)."""
    flash_attn_varlen_func = _interface()[1]
    B, H = table.shape[:2]
    D, page = k_cache.shape[-1], k_cache.shape[1]
    pages = -(-max_length // page)
    index = table[:, :, :pages].reshape(-1)
    keys = k_cache.index_select(0, index).view(B * H, pages * page, 1, D)
    values = v_cache.index_select(0, index).view(B * H, pages * page, 1, D)
    out, _ = flash_attn_varlen_func(_grouped(q, H), keys, values, seqused_k=lengths.reshape(B * H).to(torch.int32),
                                    softmax_scale=scale, causal=True)
    return _ungrouped(out, B)


def warm_up(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            page_size: int) -> None:
    """Compile (or load from the disk cache) the two kernels the engine calls, at the engine's head
    counts, head dim and page size: an engine calls it as it loads, so that no prompt waits on a compile
    and the objects the compile leaves are there before the CLI freezes the heap. Nothing where FA4 is
    not used. A package that imports but fails here (its CUDA libraries, this GPU) is switched off with
    a warning: the engine runs on its own kernels."""
    global ENABLED
    if not usable(device, dtype, head_dim):
        return
    T = 256  # past one query tile with the group folded in, as every chunk takes_chunk passes
    try:
        q = torch.zeros(1, T, num_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        kv = torch.zeros(1, T, num_kv_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        causal(q, kv, kv)
        pages = -(-T // page_size)
        cache = torch.zeros(pages, page_size, head_dim, dtype=dtype, device=device)
        table = torch.arange(pages, device=device).expand(1, num_kv_heads, pages)
        lengths = torch.full((1, num_kv_heads), T, device=device)
        paged(q, cache, cache, table, lengths)
    except Exception as error:  # noqa: BLE001 - any failure of the optional package
        ENABLED = False
        warnings.warn(f"FlashAttention-4 (flash-attn-4) failed to run and is switched off: {error!r}", stacklevel=2)
