"""LoopServe's re-selection inside a CUDA graph, its last step in one kernel: each refreshed row's
chosen tokens (ascending indices into its KV head's history, from top_k_ascending) become pool slots
through the head's page table and replace the first columns of the row's slot list. Rows whose
refresh flag is 0 keep their list. Indices at or past the head's history (a row that asked for more
tokens than it holds) map to the capacity, past every real one, so they stay last; the decode step
reads only the row's valid count.

In torch this took about ten launches per layer (where, the page lookup, the slot arithmetic and a
copy-where); the reference is turnkv/engine/graph_progressive.py `commit_slots_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_slots(top_ptr, lengths_ptr, tables_ptr, refresh_ptr, out_ptr,
                  stride_tb, stride_tr, stride_lb, stride_pb, stride_ph, stride_ob, stride_or,
                  K, P, capacity, G: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    r = tl.program_id(1)
    if tl.load(refresh_ptr + b) != 0:
        h = r // G
        j = tl.arange(0, BLOCK_K)
        ok = j < K
        top = tl.load(top_ptr + b * stride_tb + r * stride_tr + j, mask=ok, other=0)
        history = tl.load(lengths_ptr + b * stride_lb + h).to(tl.int64) - 1
        top = tl.where(top < history, top, capacity)
        page = tl.load(tables_ptr + b * stride_pb + h * stride_ph + tl.minimum(top // PAGE, P - 1), mask=ok, other=0)
        slot = page.to(tl.int64) * PAGE + top % PAGE
        tl.store(out_ptr + b * stride_ob + r * stride_or + j, slot.to(tl.int32), mask=ok)


def commit_slots(top: torch.Tensor, lengths: torch.Tensor, tables: torch.Tensor, refresh: torch.Tensor,
                 out: torch.Tensor, capacity: int, page_size: int) -> None:
    """top [B, R, K] int64 ascending token indices; lengths [B, H] int32 (the step's token included);
    tables [B, H, P] int32 pool page ids; refresh [B] (nonzero: commit the row); out [B, R, >= K]
    int32 slot lists, columns [0, K) written in the refreshed rows."""
    B, R, K = top.shape
    H, P = tables.shape[1], tables.shape[2]
    assert top.stride(-1) == 1 and tables.stride(-1) == 1 and out.stride(-1) == 1 and R % H == 0
    if B == 0 or K == 0:
        return
    _commit_slots[(B, R)](top, lengths, tables, refresh, out, top.stride(0), top.stride(1), lengths.stride(0),
                          tables.stride(0), tables.stride(1), out.stride(0), out.stride(1), K, P, capacity,
                          G=R // H, PAGE=page_size, BLOCK_K=max(2, triton.next_power_of_2(K)), num_warps=4)
