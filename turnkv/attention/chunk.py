"""Paged chunk attention on any device: a chunk of new tokens over the kept history and itself, read
from the page pool. The Triton kernel (turnkv/attention/triton/chunk_prefill.py) where it is switched
on, the reference path (reference.paged_chunk: gather the pages, mask, SDPA) elsewhere; both take the
same arguments.

Switch: the kernel is on by default for CUDA devices. TURNKV_CHUNK_KERNEL=0 in the environment (read at
import) or `chunk.ENABLED = False` turns it off; `chunk.FORCE = True` also runs it off CUDA (Triton's
interpreter on CPU), for tests. Both are read when a Step is built.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from turnkv.attention import flash, reference
from turnkv.attention.triton import available
from turnkv.gpu import num_sms

ENABLED = os.environ.get("TURNKV_CHUNK_KERNEL", "1") != "0"
FORCE = False


@functools.cache
def _kernel():
    if not available():
        return None
    from turnkv.attention.triton import chunk_prefill

    return chunk_prefill


def uses_kernel(device: torch.device) -> bool:
    """Whether later chunks on `device` take the kernel (switched on, CUDA or forced, Triton present)."""
    return ENABLED and (device.type == "cuda" or FORCE) and _kernel() is not None


def num_splits(device: torch.device, batch_kv_heads: int, num_new: int, group: int, max_length: int,
               dtype: torch.dtype) -> int:
    """Key splits for a chunk of num_new tokens over heads of at most max_length entries (1 off CUDA)."""
    if device.type != "cuda" or not uses_kernel(device):
        return 1
    kernel = _kernel()
    block_m = kernel.launch_config(dtype, 128)["block_m"]
    blocks = -(-group * num_new // block_m)
    return kernel.choose_splits(batch_kv_heads, blocks, max_length, num_sms(device.index or 0))


def kernel_takes(head_dim: int) -> bool:
    """Whether the kernel takes heads of this size (chunk_prefill.supports, for contiguous queries)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def paged_chunk(q, k_cache, v_cache, table, lengths, splits: int = 1, scale=None, window=None,
                key_positions=None, query_positions=None, k_scale=None, v_scale=None, sink: int = 0,
                ring: bool = False, heads: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] -> [B, Hq, T, D]: the T new tokens (the last T entries of every head, stored)
    over table [B, H, P] and lengths [B, H] on q's device; see reference.paged_chunk (window: an int or
    an int32 tensor [H], one per KV head; keys below `sink` stay in every window). A quantized pool
    (PagePool.scale_kwargs) adds k_scale / v_scale beside its codes.
    ring: the windowed heads are in ring form (chunk_prefill.chunk_attention: the kernel visits only
    their sink's and window's tiles; the same attention). heads: int32 [n], the only KV heads
    computed, written into their query heads' rows of `out` ([B, Hq, T, D], required then)."""
    if uses_kernel(q.device) and _kernel().supports(q, k_cache):
        return _kernel().chunk_attention(q, k_cache, v_cache, table, lengths, splits if heads is None else 1, scale,
                                         window, key_positions, query_positions, k_scale, v_scale, out=out,
                                         sink=sink, ring=ring, heads=heads)
    result = reference.paged_chunk(q, k_cache, v_cache, table, lengths, scale, window, key_positions,
                                   query_positions, k_scale, v_scale, sink)
    if heads is None:
        return result if out is None else out.copy_(result)
    B, Hq, T, D = q.shape
    G = Hq // table.shape[1]
    rows = (heads.long()[:, None] * G + torch.arange(G, device=q.device)).reshape(-1)
    out[:, rows] = result[:, rows].to(out.dtype)
    return out


# A long chunk over a long history runs faster as two dense attention calls, merged by their
# log-sum-exp, than through the paged kernel: the history gathered once (every key visible) and the
# chunk over itself (causal), both on cuDNN's flash attention (benchmarks/prefill/README.md).
# cuDNN builds an execution plan for every new shape, once per chunk (its layers share it): a later
# turn, whose lengths a conversation never repeats, pays it on every turn.
SPLIT_MIN_ROWS = 512
SPLIT_MIN_HISTORY = 8192
# new tokens x history: 4096 over 64K, 32K over 8K (every 32K slice of a long prompt after its first).
# Below it the plans' build outweighs what cuDNN's faster tiles save over the paged kernel.
SPLIT_MIN_CELLS = 1 << 28
# A step of fewer new tokens per sequence than this keeps off cuDNN's attention, which builds an
# execution plan at every new length: torch's flash attention builds nothing per shape. From it on,
# cuDNN's twice-as-fast tiles save more than its plan's build.
CUDNN_MIN_ROWS = 12288


def sdpa_backends(device: torch.device, num_new: int):
    """The SDPA backends for a step of num_new new tokens per sequence on `device` (a context manager):
    on CUDA under CUDNN_MIN_ROWS, cuDNN's attention off (decode meets a new key length at every step,
    and a conversation a new chunk length at every turn); otherwise torch's default order. The cuDNN
    calls of fresh_causal and split_history go to cuDNN directly: the switch does not reach them."""
    if device.type != "cuda" or num_new >= CUDNN_MIN_ROWS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def uses_split(device: torch.device, dtype: torch.dtype, num_new: int, history: int) -> bool:
    """Whether a chunk of num_new tokens over `history` kept tokens per head (every head the same,
    no window) takes split_history: on CUDA with cuDNN attention (fp16 / bf16), large enough to gain."""
    return (_cudnn(device, dtype) and num_new >= SPLIT_MIN_ROWS and history >= SPLIT_MIN_HISTORY
            and num_new * history >= SPLIT_MIN_CELLS)


def _cudnn(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and torch.backends.cudnn.is_available()


def split_history(q: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor, k_new: torch.Tensor,
                  v_new: torch.Tensor, scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], the T new tokens, over their history k_hist / v_hist [B, H, S, D] (every key
    visible) and themselves k_new / v_new [B, H, T, D] (causal) -> [B, Hq, T, D] in q's dtype (into
    `out` when given, any strides with a contiguous last dimension): the same attention as
    reference.causal_suffix over the two concatenated, as two calls, each with its log-sum-exp,
    merged. The history call folds each KV head's query group into its rows, so one K/V tile serves
    the group."""
    B, Hq, T, D = q.shape
    H = k_hist.shape[1]
    out_h, lse_h = _attend_with_lse(q.reshape(B, H, (Hq // H) * T, D), k_hist, v_hist, False, scale)
    out_s, lse_s = _attend_with_lse(q, k_new, v_new, True, scale)
    out_h, lse_h = out_h.reshape(B, Hq, T, D), lse_h.reshape(B, Hq, T).contiguous()
    lse_s = lse_s.contiguous()
    if q.device.type == "cuda" and available():
        from turnkv.attention.triton import lse_merge

        return lse_merge.merge(out_h, lse_h, out_s, lse_s, out)
    merged = _merge_reference(out_h, lse_h, out_s, lse_s).to(q.dtype)
    return merged if out is None else out.copy_(merged)


def _merge_reference(a, lse_a, b, lse_b) -> torch.Tensor:
    """Attention results a, b [B, Hq, T, D] over disjoint keys with their log-sum-exps [B, Hq, T] ->
    the attention over both keys, fp32."""
    lse = torch.logaddexp(lse_a, lse_b)[..., None]
    return a.float() * (lse_a[..., None] - lse).exp() + b.float() * (lse_b[..., None] - lse).exp()


def fresh_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a fresh chunk, q [B, Hq, T, D] over its own k, v [B, H, T, D] -> [B, Hq, T, D]:
    reference.causal_prefill. FlashAttention-4 where it is installed and the chunk long enough
    (flash.takes_fresh); else on CUDA in fp16 / bf16 from CUDNN_MIN_ROWS rows, cuDNN's flash attention,
    called directly (as split_history calls it, with the query groups as they are); below, SDPA under
    the step's backends (the runner's sdpa_backends: no cuDNN there)."""
    if flash.takes_fresh(q.shape[2]) and flash.usable(q.device, q.dtype, q.shape[-1]):
        return flash.causal(q, k, v)
    if q.shape[2] >= CUDNN_MIN_ROWS and _cudnn(q.device, q.dtype):
        return _cudnn_attention(q, k, v, True)[0]
    return reference.causal_prefill(q, k, v)


def _cudnn_attention(q, k, v, causal: bool, scale=None, with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's flash attention (GQA as it is): (out, log-sum-exp [B, Hq, T, 1] or an empty tensor)."""
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, with_lse, 0.0, causal, False,
                                                                scale=scale)
    return result[0], result[1]


def _attend_with_lse(q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D] over k, v [B, H, S, D] (Hq a multiple of H; causal: query t sees keys <= t)
    -> (out [B, Hq, T, D], natural-log log-sum-exp of the scaled scores [B, Hq, T], fp32)."""
    if _cudnn(q.device, q.dtype):
        out, lse = _cudnn_attention(q, k, v, causal, scale, with_lse=True)
        return out, lse.reshape(q.shape[:3]).float()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).float(), v.repeat_interleave(G, 1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v, lse
