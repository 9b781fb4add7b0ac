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

from turnkv.attention.triton import top_k

REDUCE = {"query": 0, "max": 1, "sum": 2}


@triton.jit
def _page_scores(
    q_ptr, kmax_ptr, kmin_ptr, table_ptr, lengths_ptr, out_ptr,
    stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_or,
    num_phys,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PHYS: tl.constexpr, LOGICAL: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SUB: tl.constexpr,
    REDUCE: tl.constexpr,
):
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(lengths_ptr + b * stride_lb + h)
    limit = tl.cdiv(length, PHYS) - 1  # candidates: every physical page but the newest
    SUB: tl.constexpr = PHYS // LOGICAL  # logical pages per physical page
    p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    best = tl.full([BLOCK_G, BLOCK_P], float("-inf"), tl.float32)
    if blk * BLOCK_P < limit:
        # Every logical page of the program's physical pages at once, [BLOCK_P * BLOCK_SUB] rows in
        # physical-page-major order: one table read and one statistics read in flight per program.
        n = tl.arange(0, BLOCK_P * BLOCK_SUB)
        pn = blk * BLOCK_P + n // BLOCK_SUB
        j = n % BLOCK_SUB
        token = (pn * SUB + j) * LOGICAL  # first token of logical page j of physical page pn
        valid = (pn < limit) & (j < SUB)
        page = tl.load(table_ptr + b * stride_tb + h * stride_th + token // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * (PAGE // LOGICAL) + (token % PAGE) // LOGICAL
        mask = valid[:, None] & d_ok[None, :]
        kmax = tl.load(kmax_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        kmin = tl.load(kmin_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        # Products and a row sum per query head, in fp32 on the CUDA cores: a dot here pads the
        # group (4 heads) to 16 rows and, in IEEE fp32, runs without tensor cores: many times
        # the time it takes to read the statistics.
        for gi in tl.static_range(G):
            qg = tl.load(q_ptr + b * stride_qb + (h * G + gi) * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
            s = tl.sum(tl.maximum(qg, 0.0)[None, :] * kmax + tl.minimum(qg, 0.0)[None, :] * kmin, axis=1)
            s = tl.max(tl.reshape(tl.where(valid, s, float("-inf")), [BLOCK_P, BLOCK_SUB]), axis=1)
            best = tl.where((g == gi)[:, None], s[None, :], best)
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
                out: torch.Tensor | None = None, rows_per_program: int = 32, num_warps: int = 4) -> torch.Tensor:
    """q [B, Hq, D]; kmax / kmin one layer's summaries [rows, D] (row = pool page * (page_size //
    logical_page) + sub-page); table [B, H, P] pool page ids (int32); lengths [B, H] (int32, the
    step's token included). -> fp32 scores [B, X, num_phys] (X = Hq for group "query", else H), -inf
    at pages >= the head's newest. rows_per_program: logical pages one program reads (whole physical
    pages, at least one); with num_warps, the launch setting (benchmarks/sparse/README.md)."""
    B, Hq, D = q.shape
    H = table.shape[1]
    G = Hq // H
    X = Hq if group == "query" else H
    assert q.stride(-1) == 1 and kmax.is_contiguous() and kmin.is_contiguous() and table.stride(-1) == 1
    out = torch.empty(B, X, num_phys, dtype=torch.float32, device=q.device) if out is None else out
    block_sub = triton.next_power_of_2(physical_page // logical_page)
    block_p = max(1, triton.next_power_of_2(rows_per_program) // block_sub)
    grid = (B * H, triton.cdiv(num_phys, block_p))
    _page_scores[grid](
        q, kmax, kmin, table, lengths, out,
        q.stride(0), q.stride(1), table.stride(0), table.stride(1), lengths.stride(0), out.stride(0), out.stride(1),
        num_phys,
        H=H, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PHYS=physical_page, LOGICAL=logical_page, PAGE=page_size, BLOCK_P=block_p, BLOCK_SUB=block_sub,
        REDUCE=REDUCE[group], num_warps=num_warps,
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


# Every integer argument changes with the batch bucket, the layer range or the table widths; none is
# specialised on, so a new bucket captured mid-serving compiles no new variant.
@triton.jit(do_not_specialize=[
    "stride_cl", "stride_cb", "stride_cr", "stride_tb", "stride_tr", "stride_fl", "stride_wl", "stride_wb", "stride_gl",
    "stride_gb", "stride_gh", "stride_ll", "stride_lb", "stride_ol", "stride_ob", "stride_or", "stride_nl", "stride_nb",
    "layer0", "NB"])
def _expand_pages(chosen_ptr, cand_ptr, refresh_ptr, whole_ptr, read_ptr, tables_ptr, lengths_ptr, out_ptr, out_len_ptr,
                  stride_cl, stride_cb, stride_cr, stride_tb, stride_tr, stride_fl,
                  stride_wl, stride_wb, stride_gl, stride_gb, stride_gh, stride_ll, stride_lb,
                  stride_ol, stride_ob, stride_or, stride_nl, stride_nb,
                  layer0, NB,
                  R: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RPP: tl.constexpr, P: tl.constexpr,
                  W: tl.constexpr, BLOCK_W: tl.constexpr, PHYS: tl.constexpr, SELECT: tl.constexpr,
                  BLOCK_K: tl.constexpr, C: tl.constexpr):
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
        # A refreshed row takes the top K - 1 pages of its candidates, ascending, and its newest
        # page last.
        refresh = tl.load(refresh_ptr + layer * stride_fl + b)
        if refresh != 0:
            k = tl.arange(0, BLOCK_K)
            cand = tl.load(cand_ptr + b * stride_tb + row * stride_tr + tl.arange(0, C))
            top = top_k.merge_ascending(cand, K - 1, BLOCK_K)
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
                 pages_per_phys: int, physical_page: int, candidates=None, refresh=None):
    """The rows' pool-page tables from the selections (engine/graph_paged.py PagedHandler.expand
    and, with candidates / refresh, the end of .select): one program per (layer, sequence, row).

    chosen [L, B, R, K] int64 physical pages (rows whose refresh flag is set take the top K - 1 of
    their candidates, ascending, and their newest page, written back); candidates [batch, R, C]
    int64 keys holding each row's K best pages (top_k.candidates(scores, K) or top_k.as_candidates);
    whole / read [L, B, H] int64 (1: the row reads its whole list; tokens each row reads); tables
    [L, B, H, P] int32, lengths [L, B, H] int32 (the graph's); refresh [L, B] int64. -> (tables
    [n, batch, R, kw * r] int32, lengths [n, batch, R] int32) for layers [layer0, layer0 + num_layers)."""
    L, B, R, K = chosen.shape
    H, P = tables.shape[2], tables.shape[3]
    W = kw * pages_per_phys
    BLOCK_K = triton.next_power_of_2(K)
    out = torch.empty(num_layers, batch, R, W, dtype=torch.int32, device=chosen.device)
    out_len = torch.empty(num_layers, batch, R, dtype=torch.int32, device=chosen.device)
    select = candidates is not None
    if not select:
        candidates, refresh = chosen, chosen  # unused
    C = candidates.shape[-1]
    assert chosen.is_contiguous() and whole.stride(-1) == 1 and tables.stride(-1) == 1
    assert candidates.stride(-1) == 1 and (not select or (C >= BLOCK_K and C & (C - 1) == 0)), C
    _expand_pages[(num_layers * batch * R,)](
        chosen, candidates, refresh, whole, read, tables, lengths, out, out_len,
        chosen.stride(0), chosen.stride(1), chosen.stride(2), candidates.stride(0), candidates.stride(1),
        refresh.stride(0), whole.stride(0), whole.stride(1), tables.stride(0), tables.stride(1), tables.stride(2),
        lengths.stride(0), lengths.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out_len.stride(0), out_len.stride(1),
        layer0, batch,
        R=R, G=R // H, K=K, RPP=pages_per_phys, P=P, W=W, BLOCK_W=triton.next_power_of_2(W), PHYS=physical_page,
        SELECT=select, BLOCK_K=BLOCK_K, C=C, num_warps=4,
    )
    return out, out_len
