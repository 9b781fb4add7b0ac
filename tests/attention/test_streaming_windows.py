"""attention/streaming.py: a windowed chunk on dense kernels (blocks, reversed off-diagonal blocks, the
masked history) equals reference.paged_chunk's window and sink over the same keys."""

from __future__ import annotations

import pytest
import torch

from turnkv.attention import reference, streaming


def masked_reference(q, keys, values, key_pos, q_pos, window, sink, valid):
    """Attention with the window/sink rule written out as a mask: row p sees key k when k <= p and
    (p - k < window or k < sink)."""
    p = q_pos[:, None, :, None]
    k = key_pos[:, :, None, :]
    seen = (k <= p) & ((p - k < window) | (k < sink)) & valid[:, :, None, :]
    return reference.attention(q, keys, values, seen)


@pytest.mark.parametrize("T,window,sink,history,start", [
    (40, 16, 4, 0, 0),      # fresh, two and a half blocks: the chunk's sink falls out of later rows' windows
    (48, 16, 4, 0, 0),      # fresh, whole blocks
    (75, 16, 5, 0, 0),      # fresh, five blocks: the third on see the chunk's sink in full
    (75, 8, 12, 0, 0),      # a sink longer than the window
    (12, 16, 4, 0, 0),      # fresh, shorter than the window
    (37, 10, 0, 0, 0),      # no sink
    (40, 16, 4, 11, 50),    # a later chunk over a kept sink + ring
    (9, 16, 4, 11, 50),     # a short later chunk
    (33, 8, 6, 14, 50),     # the ring longer than the window: its oldest keys fall out of every row's view
    (20, 8, 16, 10, 10),    # a history all below the sink, and the chunk's own first keys below it too
    (30, 8, 4, 20, 20),     # the history is the whole past: sink, then a run from the sink on
    (70, 16, 4, 11, 50),    # a long later chunk over a kept sink + ring
])
@pytest.mark.parametrize("B,known", [(2, False), (1, True), (2, True)])
def test_windowed_chunk_equals_the_masked_reference(T, window, sink, history, start, B, known):
    """known: the caller gives the history's layout (sink keys, then a run right before the chunk) and
    where the chunk starts, and the history runs on the dense kernels; otherwise through the mask."""
    torch.manual_seed(0)
    H, G, D = 3, 2, 16
    q = torch.randn(B, H * G, T, D)
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    starts = torch.tensor([start, start + 20 if history else start])[:B]
    q_pos = starts[:, None] + torch.arange(T)[None]
    hist, kw = None, {}
    keys, values = k, v
    key_pos = q_pos[:, None, :].expand(B, H, T)
    valid = torch.ones(B, H, T, dtype=torch.bool)
    if history:
        s0 = min(sink, history)
        ring = history - s0
        pos_h = torch.cat([torch.arange(s0)[None].expand(B, s0), starts[:, None] - ring + torch.arange(ring)[None]],
                          dim=1)[:, None].expand(B, H, history).clone()
        if B > 1:  # the second sequence: its sink, then a ring right before its own start
            assert (pos_h[1, 0, s0:] >= s0).all() or ring == 0
        valid_h = torch.ones(B, H, history, dtype=torch.bool)
        if not known:  # any validity through the mask: one head holds two entries fewer
            valid_h[:, 1, -2:] = False
        k_h, v_h = torch.randn(B, H, history, D), torch.randn(B, H, history, D)
        hist = (k_h, v_h, pos_h, valid_h)
        keys, values = torch.cat([k_h, k], 2), torch.cat([v_h, v], 2)
        key_pos = torch.cat([pos_h, key_pos], 2)
        valid = torch.cat([valid_h, valid], 2)
        if known:
            kw = dict(layout=(s0, ring))
    if known:
        kw["first_position"] = int(starts.min())
    out = streaming.windowed_chunk(q, k, v, q_pos, window, sink, hist, **kw)
    expected = masked_reference(q, keys, values, key_pos, q_pos, window, sink, valid)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_row_whose_window_is_one_key_sees_itself_and_the_sink():
    """window=1: every row sees only itself and the sink (the block decomposition's smallest block)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8)
    q_pos = torch.arange(7)[None]
    out = streaming.windowed_chunk(q, k, v, q_pos, 1, 2)
    everything = torch.ones(1, 1, 7, dtype=torch.bool)
    expected = masked_reference(q, k, v, q_pos[:, None].expand(1, 1, 7), q_pos, 1, 2, everything)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's attention in bf16)")
@pytest.mark.parametrize("history", [0, 300])
def test_windowed_chunk_on_cudnn_in_bf16(history):
    """The CUDA path (cuDNN's flash attention, the Triton merge) at a long chunk, against the fp32
    masked reference: within bf16 rounding."""
    torch.manual_seed(2)
    B, H, G, D, T, W, sink = 1, 2, 4, 128, 9000, 4096, 128
    dev = torch.device("cuda")
    q = torch.randn(B, H * G, T, D, device=dev)
    k, v = torch.randn(B, H, T, D, device=dev), torch.randn(B, H, T, D, device=dev)
    start = 5000 if history else 0
    q_pos = start + torch.arange(T, device=dev)[None]
    keys, values, key_pos = k, v, q_pos[:, None].expand(B, H, T)
    hist, kw = None, {}
    if history:
        ring = history - sink
        pos_h = torch.cat([torch.arange(sink, device=dev), start - ring + torch.arange(ring, device=dev)])
        pos_h = pos_h[None, None].expand(B, H, history).contiguous()
        k_h, v_h = torch.randn(B, H, history, D, device=dev), torch.randn(B, H, history, D, device=dev)
        hist = (k_h.bfloat16(), v_h.bfloat16(), pos_h, torch.ones(B, H, history, dtype=torch.bool, device=dev))
        keys, values, key_pos = torch.cat([k_h, k], 2), torch.cat([v_h, v], 2), torch.cat([pos_h, key_pos], 2)
        kw = dict(first_position=start, layout=(sink, history - sink))
    out = streaming.windowed_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_pos, W, sink, hist, **kw)
    expected = masked_reference(q, keys, values, key_pos, q_pos, W, sink, torch.ones_like(key_pos, dtype=torch.bool))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=3e-2)
