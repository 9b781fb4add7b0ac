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
- a kept history in a streaming head's form (sink keys, then a run of the positions right before the
  chunk) joins the chunk: the run's keys are the stretch's first keys, the sink keys one dense call
  that every row sees in full;
- the chunk's own sink keys that fell out of a row's window, and a history in any other form, are an
  explicit masked attention by position (small: at most a sink's worth of rows, or a fallback);
- the parts are merged by their log-sum-exp.
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
    run = layout[1] if has_history and layout is not None else 0
    run = min(run, window - 1)  # older keys of the run lie outside every row's window
    if run:
        # The run and the chunk are one stretch of consecutive positions: the chunk's rows are its last
        # T rows (the run's own rows are computed and dropped).
        s0, R = layout
        keys = torch.cat([history[0][:, :, s0 + R - run : s0 + R], k], 2)
        values = torch.cat([history[1][:, :, s0 + R - run : s0 + R], v], 2)
        q_run = torch.cat([q.new_zeros(B, Hq, run, D), q], 2)
        out, lse = _in_chunk(q_run, keys, values, window, scale)
        out, lse = out[:, :, run:], lse[:, :, run:]
    else:
        out, lse = _in_chunk(q, k, v, window, scale)
    for r0, part, part_lse in _outside_window(q, k, v, q_pos, window, sink, history if has_history else None,
                                              scale, first_position, layout):
        rows = slice(r0, r0 + part.shape[2])
        out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], part, part_lse)
    return out


def _in_chunk(q, k, v, W: int, scale: float):
    """The chunk over its own keys within the window: (out [B, Hq, T, D], lse [B, Hq, T] fp32)."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    if T <= W:
        return _attend(q, k, v, scale)
    nb = -(-T // W)
    pad = nb * W - T

    def blocks(x, heads):  # [B, heads, T, D] -> [B, nb, heads, W, D], rows padded at the end
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        return x.view(B, heads, nb, W, D).transpose(1, 2)

    qb, kb, vb = blocks(q, Hq), blocks(k, H), blocks(v, H)
    flat = lambda x, n: x.reshape(B * n, x.shape[2], x.shape[3], D)  # noqa: E731
    out_d, lse_d = _attend(flat(qb, nb), flat(kb, nb), flat(vb, nb), scale)
    out_d, lse_d = out_d.reshape(B, nb, Hq, W, D), lse_d.reshape(B, nb, Hq, W)
    if W > 1:
        # Block b (>= 1), row a over block b - 1, key c: seen iff c > a. Reversed (x = W - 2 - a over
        # y = W - 1 - c), rows a < W - 1 and keys c >= 1 only: seen iff y <= x, causal.
        qo = qb[:, 1:, :, : W - 1].flip(3)
        ko, vo = kb[:, :-1, :, 1:].flip(3), vb[:, :-1, :, 1:].flip(3)
        out_o, lse_o = _attend(flat(qo, nb - 1), flat(ko, nb - 1), flat(vo, nb - 1), scale)
        out_o = out_o.reshape(B * (nb - 1), Hq, W - 1, D).flip(2)
        lse_o = lse_o.reshape(B * (nb - 1), Hq, W - 1).flip(2)
        rows = (slice(None), slice(1, None), slice(None), slice(0, W - 1))
        merged, merged_lse = _merge(out_d[rows].reshape(-1, Hq, W - 1, D), lse_d[rows].reshape(-1, Hq, W - 1),
                                    out_o, lse_o)
        out_d[rows] = merged.view(B, nb - 1, Hq, W - 1, D)
        lse_d[rows] = merged_lse.view(B, nb - 1, Hq, W - 1)
    out = out_d.transpose(1, 2).reshape(B, Hq, nb * W, D)[:, :, :T]
    lse = lse_d.transpose(1, 2).reshape(B, Hq, nb * W)[:, :, :T]
    return out, lse


def _outside_window(q, k, v, q_pos, W: int, sink: int, history, scale: float, first: int, layout):
    """Keys a row sees that the windowed stretch does not: the history's keys below `sink` (seen by
    every row), the chunk's own keys below `sink` that fell out of a row's window, and, without a
    layout, the whole history (below sink or inside the window). Yields (first row, out, lse) parts
    over disjoint keys: rows that see a key partly through an explicit masked score matrix, rows that
    see all of theirs on the dense kernel."""
    B, Hq, T, D = q.shape
    own = max(0, min(T, sink - first)) if T > W else 0  # the chunk's own keys below sink, out of some window
    if history is not None and layout is None:
        # Which history keys a row sees is known only by position: a mask for every row.
        yield (0, *_masked(q, k, v, q_pos, W, sink, history, own, 0, T, scale))
        return
    s0 = layout[0] if history is not None else 0
    if s0:
        yield (0, *_few_keys(q, history[0][:, :, :s0], history[1][:, :, :s0], scale))
    if not own:
        return
    # Row t sees own key j (below sink) iff t - j >= W: rows [W, W + own - 1) some, the later rows all.
    hi = T if B > 1 else min(T, W + own - 1)  # sequences at different positions: a mask for every row
    if hi > W:
        yield (W, *_masked(q, k, v, q_pos, W, sink, None, own, W, hi, scale))
    if hi < T:
        yield (hi, *_few_keys(q[:, :, hi:], k[:, :, :own], v[:, :, :own], scale))


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


def _few_keys(q, k, v, scale: float):
    """q [B, Hq, R, D] over a few keys k, v [B, H, S, D] that every row sees (a sink): (out fp32, lse).
    Plain matrix products: the rows' count changes with every chunk, and a dense attention kernel
    (cuDNN) would build an execution plan for each new shape."""
    B, Hq, R, D = q.shape
    H = k.shape[1]
    scores = (q.reshape(B, H, Hq // H * R, D).float() @ k.float().transpose(-1, -2)) * scale  # [B, H, G*R, S]
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ v.float()
    return out.view(B, Hq, R, D), lse.view(B, Hq, R)


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
    wa, wb = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (a.float() * wa + b.float() * wb).to(a.dtype), lse
