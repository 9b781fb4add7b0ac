"""The indexed decode kernel against the reference path: page tables and slot lists, uneven lengths,
GQA groups, split-K, sliding windows. On CPU it runs in Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.attention import reference  # noqa: E402
from turnkv.attention.triton.decode import SELECTED_PROGRAMS_PER_SM, choose_splits, indexed_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter computes in numpy, which has no bfloat16.
DTYPES = [(torch.float32, 1e-3), (torch.float16, 1e-2)] + ([(torch.bfloat16, 1e-2)] if DEVICE == "cuda" else [])


def _case(B, H, G, D, page_size, num_pages, lengths, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_pages, page_size, D, generator=gen).to(DEVICE, dtype)
    q = torch.randn(B, H * G, D, generator=gen).to(DEVICE, dtype)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE).view(B, H)
    width = -(-int(lengths.max()) // page_size)
    # Each (sequence, head) owns distinct pages in a shuffled order, as the pool hands them out.
    table = torch.randperm(num_pages, generator=gen)[: B * H * width].view(B, H, width).to(DEVICE, torch.int32)
    return q, k, v, table, lengths


def _relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("G,D", [(1, 32), (3, 64), (4, 64), (8, 128)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_page_tables_with_uneven_lengths(dtype, tol, G, D, splits):
    B, H, ps = 2, 2, 4
    q, k, v, table, lengths = _case(B, H, G, D, ps, 64, [1, 37, 64, 13], dtype)
    ref = reference.indexed_decode(q.float(), k.float(), v.float(), table, lengths)
    out = torch.full_like(q, float("nan"))
    indexed_decode(q, k, v, table, lengths, splits, out=out)
    assert not out.isnan().any(), "every output element must be written"
    assert _relative_error(out, ref) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_slot_lists_select_single_tokens(dtype, tol):
    """Token selection: the table lists slots (page_size 1), in any order, with gaps."""
    B, H, G, D, ps = 2, 2, 4, 64, 8
    q, k, v, _, _ = _case(B, H, G, D, ps, 32, [1, 1, 1, 1], dtype)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(32 * ps, generator=gen)[: B * H * 50].view(B, H, 50).to(DEVICE, torch.int32)
    lengths = torch.tensor([[50, 7], [23, 1]], dtype=torch.int32, device=DEVICE)
    flat_k, flat_v = k.view(-1, 1, D), v.view(-1, 1, D)
    ref = reference.indexed_decode(q.float(), flat_k.float(), flat_v.float(), slots, lengths)
    # The same keys read as explicit rows.
    rows = slots[0, 0, :50].long()
    direct = torch.softmax((q[0, :G].float() @ flat_k[rows, 0].float().T) * D**-0.5, -1) @ flat_v[rows, 0].float()
    torch.testing.assert_close(ref[0, :G], direct, atol=1e-4, rtol=1e-4)
    out = indexed_decode(q, flat_k, flat_v, slots, lengths, 4)
    assert _relative_error(out, ref) < tol


@pytest.mark.parametrize("splits", [1, 4])
def test_sliding_window_masks_old_positions(splits):
    B, H, G, D, ps = 2, 2, 2, 32, 4
    q, k, v, table, lengths = _case(B, H, G, D, ps, 64, [30, 30, 17, 17], torch.float32)
    positions = torch.arange(64 * ps, device=DEVICE).view(64, ps)  # any distinct positions will do
    key_pos = torch.zeros_like(positions)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            slots = (table[b, h].long()[:, None] * ps + torch.arange(ps, device=DEVICE)).view(-1)[:n]
            key_pos.view(-1)[slots] = positions.view(-1)[:n]  # token i of each list sits at position i
    query_pos = (lengths[:, 0] - 1).long()
    ref = reference.indexed_decode(q, k, v, table, lengths, window=8, key_positions=key_pos,
                                   query_positions=query_pos)
    full = reference.indexed_decode(q, k, v, table, lengths)
    assert _relative_error(full, ref) > 0.05, "the window must change the result"
    out = indexed_decode(q, k, v, table, lengths, splits, window=8, key_positions=key_pos,
                         query_positions=query_pos)
    assert _relative_error(out, ref) < 1e-3


def test_more_splits_than_blocks_leave_empty_chunks_harmless():
    q, k, v, table, lengths = _case(1, 2, 4, 64, 4, 16, [3, 9], torch.float32)
    ref = reference.indexed_decode(q, k, v, table, lengths)
    out = indexed_decode(q, k, v, table, lengths, 16)
    assert _relative_error(out, ref) < 1e-3


def test_choose_splits_fills_the_machine_without_tiny_chunks():
    assert choose_splits(8, 131072, 132) == 66  # batch 1 x 8 KV heads: ~4 programs per SM
    assert choose_splits(8, 300, 132) == 5  # short lists are not cut below 64 keys
    assert choose_splits(32, 1040, 132) == 17  # LoopServe's selection, per query head
    # A selection's lists take chunks of about 64 keys: LServe's 4096 tokens per query head at batch 1.
    assert choose_splits(32, 4096, 132, programs_per_sm=SELECTED_PROGRAMS_PER_SM) == 64
    assert choose_splits(32, 1040, 132, programs_per_sm=SELECTED_PROGRAMS_PER_SM) == 17
    assert choose_splits(8 * 32, 4096, 132, programs_per_sm=SELECTED_PROGRAMS_PER_SM) == 9
    assert choose_splits(16 * 8, 4096, 132) == 5
    assert choose_splits(1024, 4096, 132) == 1
