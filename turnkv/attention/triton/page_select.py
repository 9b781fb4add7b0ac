"""Page selection kernels for decode inside a CUDA graph (Quest / LServe).

`page_scores`: per (sequence, KV head) and physical page, the upper bound max over its logical pages j
of sum_d max(q_d kmax_jd, q_d kmin_jd), read through the pool page table from the PageSummaries rows;
-inf at and past the head's newest page (the caller appends it). `fold_keys`: folds a decode step's
keys into their logical page's min/max for every layer at once (PageSummaries.update).
Torch references: turnkv/methods/lserve/selector.py `graph_page_scores_reference`, summaries.py
`fold_reference`. Design: docs/kernels.md#page-selection-quest-and-lserve"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

REDUCE = {"query": 0, "max": 1, "sum": 2}


@triton.jit
def _page_scores(
    q_ptr, kmax_ptr, kmin_ptr, table_ptr, lengths_ptr, out_ptr,
    stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_or,
    num_phys,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PHYS: tl.constexpr, LOGICAL: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, REDUCE: tl.constexpr,
):
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(lengths_ptr + b * stride_lb + h)
    limit = tl.cdiv(length, PHYS) - 1  # candidates: every physical page but the newest
    p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    best = tl.full([BLOCK_G, BLOCK_P], float("-inf"), tl.float32)
    if blk * BLOCK_P < limit:
        table = table_ptr + b * stride_tb + h * stride_th
        for j in tl.static_range(PHYS // LOGICAL):
            token = (p * (PHYS // LOGICAL) + j) * LOGICAL  # first token of logical page j of page p
            valid = (p < limit) & (token < length)
            page = tl.load(table + token // PAGE, mask=valid, other=0)
            row = page.to(tl.int64) * (PAGE // LOGICAL) + (token % PAGE) // LOGICAL
            kmax = tl.load(kmax_ptr + row[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :],
                           other=0.0).to(tl.float32)
            kmin = tl.load(kmin_ptr + row[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :],
                           other=0.0).to(tl.float32)
            # Products and a row sum per query head, in fp32 on the CUDA cores: a dot here pads the
            # group (4 heads) to 16 rows and, in IEEE fp32, runs without tensor cores: many times
            # the time it takes to read the statistics.
            for gi in tl.static_range(G):
                qg = tl.load(q_ptr + b * stride_qb + (h * G + gi) * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
                s = tl.sum(tl.maximum(qg, 0.0)[None, :] * kmax + tl.minimum(qg, 0.0)[None, :] * kmin, axis=1)
                s = tl.where(valid, s, float("-inf"))
                best = tl.where((g == gi)[:, None], tl.maximum(best, s[None, :]), best)
    p_ok = p < num_phys
    if REDUCE == 0:  # one row per query head
        tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_or + p[None, :], best,
                 mask=g_ok[:, None] & p_ok[None, :])
    else:
        if REDUCE == 1:
            row_scores = tl.max(tl.where(g_ok[:, None], best, float("-inf")), 0)
        else:
            row_scores = tl.sum(tl.where(g_ok[:, None], best, 0.0), 0)
        tl.store(out_ptr + b * stride_ob + h * stride_or + p, row_scores, mask=p_ok)


def page_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                num_phys: int, physical_page: int, logical_page: int, page_size: int, group: str = "query",
                out: torch.Tensor | None = None, block_p: int = 16) -> torch.Tensor:
    """q [B, Hq, D]; kmax / kmin one layer's summaries [rows, D] (row = pool page * (page_size //
    logical_page) + sub-page); table [B, H, P] pool page ids (int32); lengths [B, H] (int32, the
    step's token included). -> fp32 scores [B, X, num_phys] (X = Hq for group "query", else H), -inf
    at pages >= the head's newest. block_p: physical pages per program (16 is the fastest of 8 to 64
    at 128K on an H100; benchmarks/sparse/README.md)."""
    B, Hq, D = q.shape
    H = table.shape[1]
    G = Hq // H
    X = Hq if group == "query" else H
    assert q.stride(-1) == 1 and kmax.is_contiguous() and kmin.is_contiguous() and table.stride(-1) == 1
    out = torch.empty(B, X, num_phys, dtype=torch.float32, device=q.device) if out is None else out
    grid = (B * H, triton.cdiv(num_phys, block_p))
    _page_scores[grid](
        q, kmax, kmin, table, lengths, out,
        q.stride(0), q.stride(1), table.stride(0), table.stride(1), lengths.stride(0), out.stride(0), out.stride(1),
        num_phys,
        H=H, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PHYS=physical_page, LOGICAL=logical_page, PAGE=page_size, BLOCK_P=block_p, REDUCE=REDUCE[group],
        num_warps=4,
    )
    return out


@triton.jit
def _fold_keys(k_ptr, slots_ptr, kmax_ptr, kmin_ptr, stride_kl, stride_sl, stride_ml,
               D: tl.constexpr, BLOCK_D: tl.constexpr, LOGICAL: tl.constexpr):
    layer = tl.program_id(0)
    i = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    slot = tl.load(slots_ptr + layer * stride_sl + i).to(tl.int64)
    k = tl.load(k_ptr + layer * stride_kl + slot * D + d, mask=d_ok, other=0.0)
    row = layer * stride_ml + (slot // LOGICAL) * D + d
    start = (slot % LOGICAL) == 0
    kmax = tl.load(kmax_ptr + row, mask=d_ok, other=0.0)
    kmin = tl.load(kmin_ptr + row, mask=d_ok, other=0.0)
    kmax = tl.where(start, k.to(kmax.dtype), tl.maximum(kmax, k.to(kmax.dtype)))
    kmin = tl.where(start, k.to(kmin.dtype), tl.minimum(kmin, k.to(kmin.dtype)))
    tl.store(kmax_ptr + row, kmax, mask=d_ok)
    tl.store(kmin_ptr + row, kmin, mask=d_ok)


def fold_keys(pool_k: torch.Tensor, slots: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor,
              logical_page: int) -> None:
    """pool_k [L, pages, page_size, D]; slots [L, n] flat slots written this step (one per row, at
    most one per logical page except padding rows'); kmax / kmin [L, rows, D] updated in place."""
    L, n = slots.shape
    D = pool_k.shape[-1]
    assert pool_k.is_contiguous() and kmax.is_contiguous() and kmin.is_contiguous() and slots.stride(-1) == 1
    _fold_keys[(L, n)](pool_k, slots, kmax, kmin, pool_k.stride(0), slots.stride(0), kmax.stride(0),
                       D=D, BLOCK_D=triton.next_power_of_2(D), LOGICAL=logical_page, num_warps=1)


@triton.jit
def _expand_pages(chosen_ptr, top_ptr, refresh_ptr, whole_ptr, read_ptr, tables_ptr, lengths_ptr, out_ptr, out_len_ptr,
                  stride_cl, stride_cb, stride_cr, stride_tb, stride_tr, stride_fl,
                  stride_wl, stride_wb, stride_gl, stride_gb, stride_gh, stride_ll, stride_lb,
                  stride_ol, stride_ob, stride_or, stride_nl, stride_nb,
                  layer0, NB,
                  R: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RPP: tl.constexpr, P: tl.constexpr,
                  W: tl.constexpr, BLOCK_W: tl.constexpr, PHYS: tl.constexpr, SELECT: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    row = pid % R
    b = (pid // R) % NB
    dl = pid // (R * NB)  # layer offset in this launch
    layer = layer0 + dl
    h = row // G
    whole = tl.load(whole_ptr + layer * stride_wl + b * stride_wb + h)
    read = tl.load(read_ptr + layer * stride_wl + b * stride_wb + h)
    i = tl.arange(0, BLOCK_W)
    j = i // RPP
    off = i % RPP
    jc = tl.minimum(j, K - 1)
    chosen = chosen_ptr + layer * stride_cl + b * stride_cb + row * stride_cr
    if SELECT:
        # A refreshed row takes its top K - 1 pages (ascending, as top_k_ascending returns them)
        # and its newest page last.
        refresh = tl.load(refresh_ptr + layer * stride_fl + b)
        if refresh != 0:
            k = tl.arange(0, BLOCK_K)
            top = tl.load(top_ptr + b * stride_tb + row * stride_tr + k, mask=k < K - 1, other=0)
            length = tl.load(lengths_ptr + layer * stride_ll + b * stride_lb + h).to(tl.int64)
            newest = (length + PHYS - 1) // PHYS - 1
            tl.store(chosen + k, tl.where(k == K - 1, newest, top), mask=k < K)
        tl.debug_barrier()  # the row's threads read back what the others wrote
    cur = tl.load(chosen + jc)
    phys = tl.where(whole != 0, j.to(tl.int64), cur)
    col = tl.minimum(phys * RPP + off, P - 1)
    page = tl.load(tables_ptr + layer * stride_gl + b * stride_gb + h * stride_gh + col, mask=i < W, other=0)
    tl.store(out_ptr + dl * stride_ol + b * stride_ob + row * stride_or + i, page, mask=i < W)
    tl.store(out_len_ptr + dl * stride_nl + b * stride_nb + row, read.to(tl.int32))


def expand_pages(chosen, whole, read, tables, lengths, layer0: int, num_layers: int, batch: int, kw: int,
                 pages_per_phys: int, physical_page: int, top=None, refresh=None):
    """The rows' pool-page tables from the selections (engine/graph_selection.py _PagedHandler.expand
    and, with top / refresh, the end of .select): one program per (layer, sequence, row).

    chosen [L, B, R, K] int64 physical pages (rows whose refresh flag is set take the top K - 1 of
    top [batch, R, K - 1], ascending, and their newest page, written back); whole / read [L, B, H] int64
    (1: the row reads its whole list; tokens each row reads); tables [L, B, H, P] int32, lengths
    [L, B, H] int32 (the graph's); refresh [L, B] int64. -> (tables [n, batch, R, kw * r] int32,
    lengths [n, batch, R] int32) for layers [layer0, layer0 + num_layers)."""
    L, B, R, K = chosen.shape
    H, P = tables.shape[2], tables.shape[3]
    W = kw * pages_per_phys
    out = torch.empty(num_layers, batch, R, W, dtype=torch.int32, device=chosen.device)
    out_len = torch.empty(num_layers, batch, R, dtype=torch.int32, device=chosen.device)
    select = top is not None
    if not select:
        top, refresh = chosen, chosen  # unused
    assert chosen.is_contiguous() and whole.stride(-1) == 1 and tables.stride(-1) == 1 and top.stride(-1) == 1
    _expand_pages[(num_layers * batch * R,)](
        chosen, top, refresh, whole, read, tables, lengths, out, out_len,
        chosen.stride(0), chosen.stride(1), chosen.stride(2), top.stride(0), top.stride(1), refresh.stride(0),
        whole.stride(0), whole.stride(1), tables.stride(0), tables.stride(1), tables.stride(2),
        lengths.stride(0), lengths.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out_len.stride(0), out_len.stride(1),
        layer0, batch,
        R=R, G=R // H, K=K, RPP=pages_per_phys, P=P, W=W, BLOCK_W=triton.next_power_of_2(W), PHYS=physical_page,
        SELECT=select, BLOCK_K=triton.next_power_of_2(K), num_warps=4,
    )
    return out, out_len
