"""Windowed prefill attention of streaming heads (LServe, DuoAttention) on dense attention kernels.

Contract: a chunk of T new tokens at consecutive positions p0 .. p0 + T - 1 (per sequence) attends to
its own keys and a small kept history. Row at position p sees key at position k when k <= p and
(p - k < window or k < sink): reference.paged_chunk's window and sink.

LServe runs this as block-sparse attention that skips every key block outside the window. Here the
same cells run on the dense kernels the dense heads use (cuDNN's flash attention on CUDA), with no
cell outside a row's view computed beyond one block's triangle:
- the chunk is cut into blocks of `window` rows. Block b over its own keys is causal attention
  (square); block b over block b - 1 sees the keys above the diagonal (key c > row a), which is causal
  attention again once both are reversed and the empty last row and first key are dropped;
- keys that every row of a block sees in full (a kept sink; the chunk's own sink keys, for the blocks
  past the window of all of them) go before the block's keys, with as many empty rows before its
  rows: still one square causal call;
- a kept history in a streaming head's form (sink keys, then a run of the positions right before the
  chunk) joins the chunk: the run's keys are the stretch's first keys, its sink the blocks' prefix;
- the chunk's own sink keys for the rows of the second block, and a history in any other form, are an
  explicit masked attention by position (small: one block of rows over a sink, or a fallback);
- the parts are merged by their log-sum-exp.
Every call's shapes depend on the window, the sink and the number of heads, not on the chunk's
length: cuDNN builds an execution plan per new shape, and a conversation's chunks rarely repeat one.
"""

from __future__ import annotations

import torch

from turnkv.attention import chunk
from turnkv.attention.triton import available

# Rows per piece of the masked part's explicit score matrix (bounds its memory).
EXPLICIT_ROWS = 8192


def windowed_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int, sink: int,
                   history: tuple | None = None, scale: float | None = None, first_position: int = 0,
                   layout: tuple[int, int] | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] over the chunk's own k, v [B, H, T, D] (key t at position q_pos[b, t], q_pos
    [B, T] consecutive per sequence, first_position <= q_pos[:, 0] known on the host) and optional
    history (k_h, v_h [B, H, S, D], pos_h [B, H, S], valid [B, H, S] bool, every position below the
    chunk's) -> [B, Hq, T, D] in q's dtype.
    layout (s0, R): every head's history is s0 keys below `sink`, then R keys at the R positions right
    before the chunk (a streaming head's kept form, valid up to s0 + R): the history then runs on the
    dense kernels too. None: the history goes through an explicit mask (any positions, any validity)."""
    B, Hq, T, D = q.shape
    scale = D**-0.5 if scale is None else scale
    has_history = history is not None and history[0].shape[2] > 0
    if has_history and layout is None:
        # Which history keys a row sees is known only by position: the history through a mask.
        own = max(0, min(T, sink - first_position)) if T > window else 0
        out, lse = _in_chunk(q, k, v, window, scale)
        part, part_lse = _masked(q, k, v, q_pos, window, sink, history, own, 0, T, scale)
        return _merge(out, lse, part, part_lse)[0]
    s0, run = layout if has_history else (0, 0)
    every = (history[0][:, :, :s0], history[1][:, :, :s0]) if s0 else None
    # The chunk's own keys below sink (a chunk that starts below it): the rows of blocks from the third
    # on are past their window and see them all; the second block's rows, some (masked below).
    own = max(0, min(T, sink - first_position)) if T > window else 0
    if own and (B > 1 or own > window):
        # Sequences at different positions (which own keys lie below sink differs), or a sink longer
        # than the window: a mask for all rows.
        out, lse = _in_chunk(q, k, v, window, scale, every)
        part, part_lse = _masked(q, k, v, q_pos, window, sink, None, own, 0, T, scale)
        return _merge(out, lse, part, part_lse)[0]
    late = (k[:, :, :own], v[:, :, :own]) if own else None
    keep = min(run, window - 1)  # the run's older keys lie outside every row's window
    if keep:
        # The run and the chunk are one stretch of consecutive positions: the chunk's rows are its last
        # T rows (the run's own rows are computed and dropped). own = 0 here: the run lies above sink.
        keys = torch.cat([history[0][:, :, s0 + run - keep : s0 + run], k], 2)
        values = torch.cat([history[1][:, :, s0 + run - keep : s0 + run], v], 2)
        q_run = torch.cat([q.new_zeros(B, Hq, keep, D), q], 2)
        out, lse = _in_chunk(q_run, keys, values, window, scale, every)
        return out[:, :, keep:]
    out, lse = _in_chunk(q, k, v, window, scale, every, late)
    if own:
        hi = min(T, 2 * window)
        part, part_lse = _masked(q, k, v, q_pos, window, sink, None, own, window, hi, scale)
        rows = slice(window, hi)
        out[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], part, part_lse)[0]
    return out


def _in_chunk(q, k, v, W: int, scale: float, every=None, late=None):
    """The chunk over its own keys within the window: (out [B, Hq, T, D], lse [B, Hq, T] fp32).
    every / late: (keys, values) [B, H, s, D] that every row of every block / of the blocks from the
    third on (rows past the window of the chunk's first keys) sees in full, beside the window."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    Wb = min(T, W)  # one block when the chunk fits the window
    nb = -(-T // Wb)
    pad = nb * Wb - T
    # Heads into the batch: [B * H, ...], one KV head and its query group per entry.
    qh = q.reshape(B * H, G, T, D)
    kh, vh = k.reshape(B * H, 1, T, D), v.reshape(B * H, 1, T, D)

    def blocks(x):  # [N, heads, T, D] -> [N, nb, heads, Wb, D], rows padded at the end
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        return x.view(x.shape[0], x.shape[1], nb, Wb, D).transpose(1, 2)

    qb, kb, vb = blocks(qh), blocks(kh), blocks(vh)
    N = B * H
    out_d = torch.empty(N, nb, G, Wb, D, dtype=q.dtype, device=q.device)
    lse_d = torch.empty(N, nb, G, Wb, dtype=torch.float32, device=q.device)
    prefixes = [(0, min(nb, 2), every), (2, nb, _join(every, late))] if late is not None else [(0, nb, every)]
    for b0, b1, prefix in prefixes:
        if b1 <= b0:
            continue
        o, l = _diagonal(qb[:, b0:b1], kb[:, b0:b1], vb[:, b0:b1], prefix, scale)
        out_d[:, b0:b1], lse_d[:, b0:b1] = o, l
    if nb > 1 and Wb > 1:
        # Block b (>= 1), row a over block b - 1, key c: seen iff c > a. Reversed (x = W - 2 - a over
        # y = W - 1 - c), rows a < W - 1 and keys c >= 1 only: seen iff y <= x, causal.
        flat = lambda x: x.reshape(N * (nb - 1), x.shape[2], Wb - 1, D)  # noqa: E731
        qo = qb[:, 1:, :, : Wb - 1].flip(3)
        ko, vo = kb[:, :-1, :, 1:].flip(3), vb[:, :-1, :, 1:].flip(3)
        out_o, lse_o = _attend(flat(qo), flat(ko), flat(vo), scale)
        out_o = out_o.reshape(N * (nb - 1), G, Wb - 1, D).flip(2)
        lse_o = lse_o.reshape(N * (nb - 1), G, Wb - 1).flip(2)
        rows = (slice(None), slice(1, None), slice(None), slice(0, Wb - 1))
        merged, merged_lse = _merge(out_d[rows].reshape(-1, G, Wb - 1, D), lse_d[rows].reshape(-1, G, Wb - 1),
                                    out_o, lse_o)
        out_d[rows] = merged.view(N, nb - 1, G, Wb - 1, D)
        lse_d[rows] = merged_lse.view(N, nb - 1, G, Wb - 1)
    out = out_d.transpose(1, 2).reshape(B, Hq, nb * Wb, D)[:, :, :T]
    lse = lse_d.transpose(1, 2).reshape(B, Hq, nb * Wb)[:, :, :T]
    return out, lse


def _diagonal(qb, kb, vb, prefix, scale):
    """Blocks over themselves, causal, each row also over `prefix` keys in full: qb [N, n, G, Wb, D],
    kb, vb [N, n, 1, Wb, D], prefix (keys, values) [B, H, s, D] with B * H = N, or None ->
    (out [N, n, G, Wb, D], lse [N, n, G, Wb]). With a prefix, each block's rows follow s empty rows
    and its keys follow the prefix: one square causal call of s + Wb."""
    N, n, G, Wb, D = qb.shape
    if prefix is None:
        flat = lambda x: x.reshape(N * n, x.shape[2], Wb, D)  # noqa: E731
        out, lse = _attend(flat(qb), flat(kb), flat(vb), scale)
        return out.reshape(N, n, G, Wb, D), lse.reshape(N, n, G, Wb)
    s = prefix[0].shape[2]
    q_full = qb.new_zeros(N, n, G, s + Wb, D)
    q_full[..., s:, :] = qb
    keys = torch.cat([prefix[0].reshape(N, 1, 1, s, D).expand(N, n, 1, s, D), kb], 3)
    values = torch.cat([prefix[1].reshape(N, 1, 1, s, D).expand(N, n, 1, s, D), vb], 3)
    out, lse = _attend(q_full.view(N * n, G, s + Wb, D), keys.view(N * n, 1, s + Wb, D),
                       values.view(N * n, 1, s + Wb, D), scale)
    out = out.reshape(N, n, G, s + Wb, D)[..., s:, :]
    lse = lse.reshape(N, n, G, s + Wb)[..., s:]
    return out, lse


def _join(a, b):
    """Two (keys, values) prefixes, either None, one after the other."""
    if a is None or b is None:
        return a if b is None else b
    return torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2)


def _masked(q, k, v, q_pos, W: int, sink: int, history, own: int, lo: int, hi: int, scale: float):
    """Rows [lo, hi) over the history and the chunk's first `own` keys with the window/sink rule as an
    explicit mask (fp32 scores) -> (out [B, Hq, hi - lo, D] fp32, lse [B, Hq, hi - lo]; -inf where a
    row sees none of them)."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    parts_k, parts_v, parts_pos, parts_valid, parts_hist = [], [], [], [], []
    if history is not None:
        k_h, v_h, pos_h, valid_h = history
        parts_k.append(k_h), parts_v.append(v_h), parts_pos.append(pos_h), parts_valid.append(valid_h)
        parts_hist.append(torch.ones(pos_h.shape[2], dtype=torch.bool, device=q.device))
    if own:
        parts_k.append(k[:, :, :own]), parts_v.append(v[:, :, :own])
        parts_pos.append(q_pos[:, None, :own].expand(B, H, own))
        parts_valid.append(torch.ones(B, H, own, dtype=torch.bool, device=q.device))
        parts_hist.append(torch.zeros(own, dtype=torch.bool, device=q.device))
    keys, values = torch.cat(parts_k, 2).float(), torch.cat(parts_v, 2).float()
    key_pos, valid, is_hist = torch.cat(parts_pos, 2), torch.cat(parts_valid, 2), torch.cat(parts_hist)
    G = Hq // H
    out = torch.empty(B, Hq, hi - lo, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, hi - lo, device=q.device)
    for r0 in range(lo, hi, EXPLICIT_ROWS):
        r1 = min(hi, r0 + EXPLICIT_ROWS)
        p = q_pos[:, None, r0:r1, None]  # [B, 1, R, 1]
        kp = key_pos[:, :, None, :]  # [B, H, 1, S]
        # History: below sink or in the window (always behind the chunk). Own keys: below sink and out
        # of the window (_in_chunk has those inside it).
        seen = torch.where(is_hist, (kp < sink) | (p - kp < W), (kp < sink) & (p - kp >= W)) & valid[:, :, None, :]
        qf = q[:, :, r0:r1].float().view(B, H, G, r1 - r0, D)
        scores = (qf @ keys[:, :, None].transpose(-1, -2)) * scale  # [B, H, G, R, S]
        scores = scores.masked_fill(~seen[:, :, None], float("-inf"))
        part_lse = scores.logsumexp(-1)
        weights = (scores - torch.where(part_lse.isinf(), 0.0, part_lse)[..., None]).exp()
        out[:, :, r0 - lo : r1 - lo] = (weights @ values[:, :, None]).view(B, Hq, r1 - r0, D)
        lse[:, :, r0 - lo : r1 - lo] = part_lse.view(B, Hq, r1 - r0)
    return out, lse


def _attend(q, k, v, scale):
    """Causal attention of square blocks q [N, Hq, R, D] over k, v [N, H, R, D] with its log-sum-exp."""
    return chunk._attend_with_lse(q, k, v, True, scale)


def _merge(a, lse_a, b, lse_b):
    """Two results over disjoint keys -> (merged in a's dtype, merged lse). lse_a is finite on every row
    (a row always sees itself in `a`); lse_b may be -inf (no key)."""
    lse = torch.logaddexp(lse_a, lse_b)
    if a.device.type == "cuda" and available() and a.stride(-1) == 1 and b.stride(-1) == 1:
        from turnkv.attention.triton import lse_merge

        return lse_merge.merge(a, lse_a.contiguous(), b, lse_b.contiguous()), lse
    return chunk._merge_reference(a, lse_a, b, lse_b).to(a.dtype), lse
