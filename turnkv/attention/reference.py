"""Reference attention in plain PyTorch: explicit masks and gathers, GQA without repeating K/V.

This is the ground truth the fast kernels are tested against, and the engine's path on CPU.
Shapes: B batch, Hq query heads, H KV heads, G = Hq // H, T new tokens, S kept tokens, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_pages(pool: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of a layer's pool [num_pages, page_size, ...] for page tables [B, H, P] -> [B, H, length, ...]."""
    B, H, _ = tables.shape
    pages = -(-length // pool.shape[1])
    # index_select copies whole pages; it is several times faster than advanced indexing on CPU.
    rows = pool.index_select(0, tables[:, :, :pages].reshape(-1))
    return rows.view(B, H, pages * pool.shape[1], *pool.shape[2:])[:, :, :length]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored int8/fp8 codes [..., D] and their fp32 scales [...] -> rows in `dtype` (codes * scale,
    in fp32): how every attention path reads a quantized pool (turnkv.kv.quant writes it)."""
    return (codes.float() * scale[..., None].float()).to(dtype)


def causal_mask(lengths: torch.Tensor, num_new: int, num_keys: int) -> torch.Tensor:
    """Visibility [B, H, T, S] when the T new tokens are the last T entries of each head.

    Head h of sequence b holds lengths[b, h] tokens; new token t sees entries j <= lengths - T + t,
    i.e. all kept history and the new tokens up to itself. Entries past the length are padding.
    """
    j = torch.arange(num_keys, device=lengths.device)
    t = torch.arange(num_new, device=lengths.device)
    last_visible = lengths[:, :, None] - num_new + t  # [B, H, T]
    return j <= last_visible[..., None]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """q [B, Hq, T, D] over k, v [B, H, S, D] with a per-KV-head mask [B, H, T, S] (True = attend),
    or one mask [B, 1, T, S] shared by all heads.

    The G query heads of a group are folded into the row dimension, so each KV head is read once
    for its whole group and K/V are never repeated.
    """
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    if mask is not None and mask.shape[1] == 1:
        # One mask for every head (equal lengths): SDPA broadcasts it, no per-group copy.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    q_grouped = q.reshape(B, H, G * T, D)
    if mask is not None:
        mask = mask[:, :, None].expand(B, H, G, T, mask.shape[-1]).reshape(B, H, G * T, -1)
    out = F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, T, D)


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention of a fresh sequence: no history, every head the same length."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)


def causal_suffix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] are the last T of the S keys every head holds: query t sees keys j <= S - T + t.
    Same result as attention() with causal_mask, but no mask tensor, so SDPA can pick flash attention
    (faster than attention with a mask tensor, most of all for long chunks)."""
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    # Imported here: torch.nn.attention.bias pulls in torch._dynamo (about a second), which nothing
    # else at start-up needs (`turnkv info` reads shapes only).
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scale, enable_gqa=True)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None) -> torch.Tensor:
    """Softmax weights [B, Hq, T, S] of the same attention, for scorers and tests."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    scores = torch.einsum("bhgtd,bhsd->bhgts", q.reshape(B, H, Hq // H, T, D).float(), k.float())
    scores = scores * (scale if scale is not None else D**-0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    return scores.softmax(dim=-1).reshape(B, Hq, T, -1)


def indexed_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                   lengths: torch.Tensor, scale: float | None = None, window: int | None = None,
                   key_positions: torch.Tensor | None = None, query_positions: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], over the first lengths[b, h] entries named by table [B, H, P]
    in one layer's pool [num_pages, page_size, D] (page_size 1 when the table lists single slots).
    With a window, only keys whose position is above query_positions[b] - window count.
    A quantized pool passes its codes as k_cache / v_cache and their per-slot scales k_scale / v_scale
    [num_pages, page_size]: the rows are dequantized after the gather, into q's dtype.
    The contract of the Triton kernel in turnkv/attention/triton/decode.py."""
    S = int(lengths.max())
    keys = gather_pages(k_cache, table, S)
    values = gather_pages(v_cache, table, S)
    if k_scale is not None:
        keys = dequantize(keys, gather_pages(k_scale, table, S), q.dtype)
        values = dequantize(values, gather_pages(v_scale, table, S), q.dtype)
    mask = torch.arange(S, device=q.device) < lengths[:, :, None].long()  # [B, H, S]
    if window is not None:
        key_pos = gather_pages(key_positions, table, S)
        mask = mask & (key_pos > (query_positions[:, None, None] - window))
    return attention(q[:, :, None], keys, values, mask[:, :, None], scale)[:, :, 0]


def paged_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                lengths: torch.Tensor, scale: float | None = None, window: int | None = None,
                key_positions: torch.Tensor | None = None, query_positions: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                sink: int = 0) -> torch.Tensor:
    """A chunk of T new queries per sequence, q [B, Hq, T, D], over the first lengths[b, h] entries named
    by table [B, H, P] in one layer's pool [num_pages, page_size, D], the T new tokens being the last T
    entries of every head (already stored): query t sees entries j <= lengths - T + t (causal_mask).
    With a window, only keys whose position (key_positions [num_pages, page_size]) is above
    query_positions [B, T] - window, or below `sink`; window is an int or a tensor [H] (one per KV
    head). A quantized pool passes its codes and per-slot scales k_scale /
    v_scale [num_pages, page_size], dequantized after the gather into q's dtype. -> [B, Hq, T, D].
    The contract of the Triton kernel in turnkv/attention/triton/chunk_prefill.py."""
    T = q.shape[2]
    S = int(lengths.max())
    keys = gather_pages(k_cache, table, S)
    values = gather_pages(v_cache, table, S)
    if k_scale is not None:
        keys = dequantize(keys, gather_pages(k_scale, table, S), q.dtype)
        values = dequantize(values, gather_pages(v_scale, table, S), q.dtype)
    mask = causal_mask(lengths.long(), T, S)
    if window is not None:
        key_pos = gather_pages(key_positions, table, S)
        if isinstance(window, torch.Tensor):
            window = window.to(key_pos.device, torch.int64)[None, :, None, None]
        in_window = key_pos[:, :, None, :] > query_positions[:, None, :, None] - window
        mask = mask & (in_window | (key_pos[:, :, None, :] < sink))
    return attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale)
