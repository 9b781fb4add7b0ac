"""Hierarchical page selection for decode (LServe, with Quest as the one-level case).

A logical page scores S_j = sum_d max(q_d kmax_jd, q_d kmin_jd), a physical page the max of its
logical pages; per head the top pages fill the token budget, the newest page is always read, and a
head within budget keeps all its pages. Per query head by default (group="query": tables with Hq rows,
read as G = 1), or per KV head with group="max" / "sum". A selection serves `reuse_interval` steps per
conversation and layer (SelectionState); a new physical page forces a refresh. Output tables list pool
pages, selected physical pages ascending, the newest last. Design: docs/methods/lserve.md#page-selection-in-detail"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.attention import decode, top_k
from turnkv.gpu import upload

GROUPS = ("query", "max", "sum")


@dataclass
class SelectorConfig:
    physical_page: int = 64
    logical_page: int = 16
    token_budget: int = 4096
    reuse_interval: int = 4
    group: str = "query"
    min_pages: int = 3  # LServe's floor: k = max(3, budget // page)
    dense_layers: int = 0  # layers below this read every page (Quest keeps its first two layers dense)

    def __post_init__(self):
        if self.logical_page < 1 or self.physical_page % self.logical_page:
            raise ValueError(f"physical_page ({self.physical_page}) must be a multiple of logical_page "
                             f"({self.logical_page})")
        if self.token_budget <= 0 or self.token_budget % self.physical_page:
            raise ValueError(f"token_budget ({self.token_budget}) must be a positive multiple of "
                             f"physical_page ({self.physical_page})")
        if self.reuse_interval < 1:
            raise ValueError(f"reuse_interval must be >= 1, got {self.reuse_interval}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")
        if self.min_pages < 1:
            raise ValueError(f"min_pages must be >= 1, got {self.min_pages}")

    @classmethod
    def quest(cls, token_budget: int = 4096, **overrides) -> SelectorConfig:
        """Quest: one level of 16-token pages, reselected every step, first two layers dense."""
        return cls(**{"physical_page": 16, "logical_page": 16, "token_budget": token_budget,
                      "reuse_interval": 1, "dense_layers": 2, **overrides})

    @property
    def pages_budget(self) -> int:
        return max(self.min_pages, self.token_budget // self.physical_page)


def page_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, lengths: torch.Tensor,
                config: SelectorConfig) -> torch.Tensor:
    """q [B, Hq, D]; kmax/kmin [B, H, n_log, D] with n_log a multiple of the logical pages per
    physical page; lengths [B, H]. -> physical page scores [B, H, G, n_phys], -inf for pages past
    a head's length.

    max(q·kmax, q·kmin) per channel is q⁺·kmax + q⁻·kmin (kmax >= kmin), so the scores are two
    batched matmuls instead of a [.., n_log, D] temporary."""
    B, Hq, D = q.shape
    H, n_log = kmax.shape[1], kmax.shape[2]
    g = config.physical_page // config.logical_page
    if n_log % g:
        raise ValueError(f"{n_log} logical pages do not fill physical pages of {g}")
    qg = q.view(B, H, Hq // H, D).float()
    scores = (torch.einsum("bhgd,bhnd->bhgn", qg.clamp(min=0), kmax.float())
              + torch.einsum("bhgd,bhnd->bhgn", qg.clamp(max=0), kmin.float()))
    valid = torch.arange(n_log, device=q.device) * config.logical_page < lengths[:, :, None]
    scores = torch.where(valid[:, :, None], scores, float("-inf"))  # also clears inf*0 of unwritten pages
    return scores.view(B, H, Hq // H, n_log // g, g).amax(-1)


def graph_page_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, table: torch.Tensor,
                      lengths: torch.Tensor, num_phys: int, config: SelectorConfig, page_size: int) -> torch.Tensor:
    """The candidates' scores for a selection inside a CUDA graph: q [B, Hq, D] (post-RoPE); kmax /
    kmin one layer's PageSummaries rows [rows, D]; table [B, H, P] the heads' pool page tables (int32)
    and lengths [B, H] (int32, the step's token included), capacity-padded. -> fp32 [B, X, num_phys]
    (X = Hq for group "query", else H; the group's scores reduced by max or sum): page_scores of
    every physical page before the head's newest, -inf from the newest on (it is forced, not chosen).

    The Triton kernel on CUDA (it skips the pages past each head's live length); the reference below
    elsewhere."""
    if decode.uses_kernel(q.device):
        from turnkv.attention.triton import page_select

        return page_select.page_scores(q, kmax, kmin, table, lengths, num_phys, config.physical_page,
                                       config.logical_page, page_size, config.group)
    return graph_page_scores_reference(q, kmax, kmin, table, lengths, num_phys, config, page_size)


def graph_page_scores_reference(q, kmax, kmin, table, lengths, num_phys: int, config: SelectorConfig,
                                page_size: int) -> torch.Tensor:
    """graph_page_scores in torch: the same arithmetic as the eager selector (page_scores over the
    statistics gathered through the tables), over num_phys pages."""
    B, Hq, D = q.shape
    H, P = table.shape[1], table.shape[2]
    lp = config.logical_page
    tokens = torch.arange(num_phys * (config.physical_page // lp), device=q.device) * lp  # each logical page's first
    cols = (tokens // page_size).clamp(max=P - 1)
    rows = table.long()[:, :, cols] * (page_size // lp) + (tokens % page_size) // lp  # [B, H, n_log]
    scores = page_scores(q, kmax[rows], kmin[rows], lengths.long(), config)  # [B, H, G, num_phys]
    if config.group == "query":
        scores = scores.reshape(B, Hq, num_phys)
    elif config.group == "max":
        scores = scores.amax(2)
    else:
        scores = scores.sum(2)
    newest = -(-lengths.long() // config.physical_page) - 1  # [B, H]
    if scores.shape[1] != H:
        newest = newest.repeat_interleave(scores.shape[1] // H, dim=1)
    return scores.masked_fill(torch.arange(num_phys, device=q.device) >= newest[..., None], float("-inf"))


def choose_pages(scores: torch.Tensor, num_pages: torch.Tensor, config: SelectorConfig,
                 any_over: bool | None = None) -> torch.Tensor:
    """scores [B, X, n_phys] per selecting head, num_pages [B, X] physical pages each head holds.
    -> physical page ids [B, X, K] ascending, the newest (num_pages - 1) last for heads over budget;
    0..K-1 for heads within it (K = min(pages_budget, n_phys); entries past num_pages are unused).
    any_over: whether some head is over budget, when the caller knows it on the host (spares a sync)."""
    B, X, n_phys = scores.shape
    K = min(config.pages_budget, n_phys)
    everything = torch.arange(K, device=scores.device).expand(B, X, K)
    over = num_pages > config.pages_budget
    if K < 2 or not (bool(over.any()) if any_over is None else any_over):
        return everything
    col = torch.arange(n_phys, device=scores.device)
    candidates = scores.masked_fill(col >= (num_pages[..., None] - 1), float("-inf"))  # not the newest
    top = top_k.top_k_ascending(candidates, K - 1)
    chosen = torch.cat([top, (num_pages - 1)[..., None]], dim=-1)
    return torch.where(over[..., None], chosen, everything)


def to_pool_tables(chosen: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, page_size: int,
                   config: SelectorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical page ids [B, X, K] -> pool page tables [B, X, K * r] (int32) and the token counts
    [B, X] (int32) indexed_decode reads through them. tables [B, X, P] / lengths [B, X] are the
    heads' full pool tables and lengths, already in the X layout."""
    if config.physical_page % page_size:
        raise ValueError(f"physical pages of {config.physical_page} tokens must be whole pool pages of {page_size}")
    r = config.physical_page // page_size
    B, X, K = chosen.shape
    cols = (chosen[..., None] * r + torch.arange(r, device=chosen.device)).reshape(B, X, K * r)
    # Columns past a head's pages (the unused tail of its newest physical page) are never read.
    cols = cols.clamp(max=tables.shape[2] - 1)
    pool_tables = tables.gather(2, cols.to(torch.int64))
    lengths = lengths.long()
    num_pages = -(-lengths // config.physical_page)
    count = torch.minimum(num_pages, torch.full_like(num_pages, K))
    # Every chosen page is full except the newest: (count - 1) full pages + the newest's tokens.
    read = (count - 1) * config.physical_page + lengths - (num_pages - 1) * config.physical_page
    read = torch.where(lengths > 0, read, torch.zeros_like(read))
    return pool_tables.to(torch.int32), read.to(torch.int32)


class SelectionState:
    """One conversation's cached selections, per layer. Call invalidate() on prefill, eviction,
    truncation, restore or preemption: anything that changes its pages other than decode appends."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.invalidate()
        self.selections = [0] * num_layers  # fresh selections run, per layer (metrics and tests)

    def invalidate(self) -> None:
        self.chosen = [None] * self.num_layers  # [X, K] physical page ids
        self.num_pages = [None] * self.num_layers  # host [H] physical pages at selection time
        self.age = [0] * self.num_layers  # decode steps served by the cached selection


class PageSelector:
    def __init__(self, config: SelectorConfig | None = None):
        self.config = config or SelectorConfig()

    def select(self, layer: int, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, summaries,
               states: list[SelectionState], dense: torch.Tensor | None = None,
               host_lengths: np.ndarray | None = None, tables_out: bool = True):
        """One decode step of `layer` for B conversations.

        q [B, Hq, D] (post-RoPE); tables [B, H, P] pool page ids and lengths [B, H] of the heads'
        whole history (this step's token included); summaries: PageSummaries; states: one
        SelectionState per conversation; dense [H] bool: heads that select (streaming heads keep
        their whole, already small, table); host_lengths: lengths as numpy, to spare a device sync.
        -> (tables [B, X, W] int32, lengths [B, X] int32) for indexed_decode, X = Hq for
        group="query", else H; None with tables_out=False (the caller reads states[b].chosen).

        A cached selection is made again when it is `reuse_interval` steps old, or when a selecting
        head's physical page count changed (a new page opened: the forced newest page would be stale)."""
        cfg = self.config
        B, Hq, _ = q.shape
        H = tables.shape[1]
        G = Hq // H
        per_query = cfg.group == "query"
        expand = (lambda t: t.repeat_interleave(G, dim=1)) if per_query else (lambda t: t)
        if len(states) != B:
            raise ValueError(f"{B} conversations but {len(states)} selection states")
        if host_lengths is None:
            host_lengths = lengths.cpu().numpy()
        host_pages = -(-np.asarray(host_lengths, dtype=np.int64) // cfg.physical_page)  # [B, H]
        if layer < cfg.dense_layers or host_pages.max(initial=0) <= cfg.pages_budget:
            # Within budget everywhere: every page, no scoring (and nothing to cache).
            return expand(tables).to(torch.int32), expand(lengths).to(torch.int32)

        dense_host = np.ones(H, dtype=bool) if dense is None else dense.cpu().numpy()
        selecting_pages = np.where(dense_host, host_pages, 0)  # streaming heads never select
        refresh = [b for b, s in enumerate(states) if not isinstance(s.chosen[layer], torch.Tensor)
                   or s.age[layer] >= cfg.reuse_interval or not np.array_equal(s.num_pages[layer], selecting_pages[b])]
        if refresh:
            fresh = self._fresh(layer, q[refresh], tables[refresh], lengths[refresh], summaries,
                                dense, upload(host_pages[refresh], q.device),
                                any_over=bool((selecting_pages[refresh] > cfg.pages_budget).any()))
            for b, row in zip(refresh, fresh.unbind(0)):  # one view per conversation, in one call
                s = states[b]
                s.chosen[layer], s.num_pages[layer], s.age[layer] = row, selecting_pages[b].copy(), 0
                s.selections[layer] += 1
        for s in states:
            s.age[layer] += 1
        if not tables_out:
            return None
        width = max(s.chosen[layer].shape[-1] for s in states)
        chosen = torch.stack([torch.nn.functional.pad(s.chosen[layer], (0, width - s.chosen[layer].shape[-1]))
                              for s in states])
        page_size = summaries.pool.page_size
        r = cfg.physical_page // page_size
        # Room for every chosen page's r pool pages, so the gather never clips a real column.
        padded = torch.nn.functional.pad(tables, (0, max(0, host_pages.max() * r - tables.shape[2])))
        out_tables, out_lengths = to_pool_tables(chosen, expand(padded), expand(lengths), page_size, cfg)
        if dense is not None and not bool(dense.all()):
            # Streaming heads read their whole table (sink + local pages in the two-way store).
            full_tables, full_lengths = expand(tables).to(torch.int32), expand(lengths).to(torch.int32)
            width = max(out_tables.shape[2], full_tables.shape[2])
            out_tables, full_tables = (torch.nn.functional.pad(t, (0, width - t.shape[2]))
                                       for t in (out_tables, full_tables))
            keep = expand(dense.to(q.device)[None].expand(B, H))
            out_tables = torch.where(keep[..., None], out_tables, full_tables)
            out_lengths = torch.where(keep, out_lengths, full_lengths)
        return out_tables, out_lengths

    def _fresh(self, layer, q, tables, lengths, summaries, dense, num_pages, any_over=None) -> torch.Tensor:
        cfg = self.config
        B, Hq, _ = q.shape
        H = tables.shape[1]
        r = cfg.physical_page // summaries.pool.page_size
        n_phys = int(num_pages.max())
        tables = torch.nn.functional.pad(tables, (0, max(0, n_phys * r - tables.shape[2])))[:, :, : n_phys * r]
        kmax, kmin = summaries.gather(layer, tables)
        scores = page_scores(q, kmax, kmin, lengths, cfg)  # [B, H, G, n_phys]
        selecting = num_pages if dense is None else torch.where(upload(dense, q.device)[None], num_pages, 0)
        if cfg.group == "query":
            scores, selecting = scores.reshape(B, Hq, n_phys), selecting.repeat_interleave(Hq // H, dim=1)
        elif cfg.group == "max":
            scores = scores.amax(2)
        else:
            scores = scores.sum(2)
        # Streaming heads are "within budget" (0 pages selecting): they keep 0..K-1, i.e. their table.
        return choose_pages(scores, selecting, cfg, any_over)
