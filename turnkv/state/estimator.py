"""Krul's token-wise heterogeneous attention similarity estimator, from recorded queries.

Per conversation: each layer's I-R score (attention mass on the first and last 10% of the tokens) and
the Euclidean distance between every two layers' attention maps, per head. The turn's post-RoPE queries
(TurnQueries) are replayed in query chunks against the keys the conversation holds, so no O(s^2) map is
kept: memory O(layers x heads x chunk x s). `where`: "device" (every row on the pool's device) or "cpu"
(the paper's split: prefill rows on a CPU worker); `max_rows` samples long turns (an estimate). Columns
are key positions, so layers that evicted different tokens stay comparable.
Design: docs/methods/krul.md#the-attention-estimator"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from turnkv.attention.reference import gather_pages
from turnkv.methods.window import QueryWindow
from turnkv.model.parallel import all_reduce

# A chunk's fp32 attention rows over every layer and a pass's heads, with the score GEMM's output
# beside them (the peak extra memory): large on a GPU (fewer, larger GEMMs), small on a CPU (cache-friendly).
CHUNK_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}
KEY_CACHE_BYTES = 1 << 30  # a pass's keys over every layer (in the score dtype) take at most this


class TurnQueries(QueryWindow):
    """A QueryWindow (the eviction methods' observation window, when they have one) that also keeps
    every query of the current turn, per layer, with whether it came from a decode step."""

    def __init__(self, num_layers: int, size: int):
        super().__init__(num_layers, size)
        self.turn: list[list[tuple[torch.Tensor, torch.Tensor, bool]]] = [[] for _ in range(num_layers)]
        self._flushing = False

    def flush(self) -> None:
        # Only decode steps (record_all, the CUDA-graph path) are pending; they file in batches.
        self._flushing = True
        try:
            super().flush()
        finally:
            self._flushing = False

    def _file(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        if self.size:
            super()._file(layer, q, positions)
        decode = self._flushing or len(positions) == 1
        self.turn[layer].append((q.detach().clone(), positions.clone(), decode))

    def truncate(self, num_positions: int) -> None:
        super().truncate(num_positions)  # files what is pending first
        self.turn = [[(q[p < num_positions], p[p < num_positions], d) for q, p, d in layer] for layer in self.turn]

    def snapshot(self):
        return super().snapshot(), [list(layer) for layer in self.turn]

    def restore(self, snapshot) -> None:
        window, turn = snapshot
        super().restore(window)
        self.turn = [list(layer) for layer in turn]

    def clear(self) -> None:
        super().clear()
        self.turn = [[] for _ in self.turn]

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(queries per layer [T, Hq, D], positions [T], is_decode [T]) of the turn, and forget them."""
        self.flush()
        records = self.turn[0]
        positions = torch.cat([p for _, p, _ in records]) if records else torch.zeros(0, dtype=torch.int64)
        is_decode = torch.cat([torch.full((len(p),), d) for _, p, d in records]) if records else torch.zeros(0, dtype=torch.bool)
        queries = [torch.cat([q for q, _, _ in layer]) if layer else None for layer in self.turn]
        self.turn = [[] for _ in self.turn]
        return queries, positions, is_decode


class _Keys:
    """Every layer's keys on one device, `heads_per_pass` KV heads (Hg) at a time (heads(h0, h1)): all
    of them, gathered here once, when every layer's keys fit KEY_CACHE_BYTES or go to another device
    than the pool's (the CPU worker's host copy, gathered on the caller's thread); else the largest
    divisor of the KV heads whose keys fit, gathered once per pass. Only __init__ reads the sequence
    (its page table, lengths and positions count); a pass reads the pool alone.
    `full`: every head of every layer holds positions 0..P-1 (the common case): a pass's keys are one
    [N, Hg, P, D] tensor, no scatter, no validity mask. Else a list per layer of (k [Hg, S, D],
    positions [Hg, S], validity [Hg, S]), positions and validity None for a layer that holds them all."""

    def __init__(self, seq, device: torch.device, dtype: torch.dtype):
        self.pool, self.device, self.dtype = seq.pool, device, dtype
        pool = seq.pool
        self.lengths, self.P = seq.lengths.copy(), seq.next_position
        self.layer_full = [bool((self.lengths[layer] == self.P).all()) for layer in range(pool.num_layers)]
        self.full = all(self.layer_full)
        self.table = seq.device_table()  # [N, H, pages] on the pool's device
        H = self.num_heads = pool.num_kv_heads
        per_head = int(self.lengths.max(axis=1).sum()) * pool.head_dim * torch.empty((), dtype=dtype).element_size()
        fit = H if device != pool.device else KEY_CACHE_BYTES // max(1, per_head)  # a host copy: all at once
        self.heads_per_pass = max(d for d in range(1, H + 1) if H % d == 0 and d <= max(1, fit))
        self.cache = self._gather(0, H) if self.heads_per_pass == H else None

    def heads(self, h0: int, h1: int):
        return self.cache if self.cache is not None else self._gather(h0, h1)

    def _gather(self, h0: int, h1: int):
        pool, P, N = self.pool, self.P, self.pool.num_layers
        if not self.full:
            return [self._layer(layer, h0, h1) for layer in range(N)]
        if self.device == pool.device:  # every layer in one gather
            layers = torch.arange(N, device=pool.device)
            return pool.gather(layers, self.table[:, h0:h1], P, "k").to(self.dtype)
        # to another device (the CPU worker's copy): one layer at a time, so the pool's device holds one
        # layer's gather beside the pass
        k = torch.empty(N, h1 - h0, P, pool.head_dim, dtype=self.dtype, device=self.device)
        for layer in range(N):
            k[layer] = pool.gather(layer, self.table[layer][None, h0:h1], P, "k")[0]
        return k

    def _layer(self, layer: int, h0: int, h1: int):
        pool = self.pool
        lengths = self.lengths[layer, h0:h1]
        S = int(lengths.max(initial=0))
        table = self.table[layer][None, h0:h1]
        k = pool.gather(layer, table, S, "k")[0].to(self.device, self.dtype)
        if self.layer_full[layer]:
            return k, None, None
        pos = gather_pages(pool.positions[layer], table, S)[0].to(self.device)
        valid = torch.arange(S, device=self.device)[None] < torch.from_numpy(lengths).to(self.device)[:, None]
        return k, pos, valid


def _accumulate(queries: list[torch.Tensor], q_pos: torch.Tensor, keys: _Keys, num_positions: int, ir_regions,
                chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrices [Hq, N, N] of the attention rows of `queries` (per layer [T, Hq, D], on the keys'
    device) over the layers' keys, and the I-R mass per layer [N] (summed over heads and rows).
    q_pos: the rows' positions, on the host.

    A pass takes keys.heads_per_pass KV heads (Hg) of every layer; a chunk, `chunk_rows` rows of the
    pass (default: as many as CHUNK_BYTES holds, rows and score temporaries counted). With every layer
    full, a chunk is one batched score GEMM over [N * Hg] (bf16 on the GPU), one mask, one softmax
    into fp32 rows [N, Hg * G, c, P]; then one batched GEMM over the pass's query heads adds the Gram
    terms of every layer pair. Nothing in the loop waits for the device."""
    N = len(queries)
    T, Hq, D = queries[0].shape
    device, P = keys.device, num_positions
    gram = torch.zeros(Hq, N, N, dtype=torch.float32, device=device)
    ir_mass = torch.zeros(N, dtype=torch.float64, device=device)
    if T == 0:
        return gram, ir_mass
    H, Hg = keys.num_heads, keys.heads_per_pass
    G = Hq // H
    in_place = keys.dtype == torch.float32  # scores straight into the fp32 rows: no temporary
    per_row = N * Hg * G * P * (4 + (0 if in_place else keys.dtype.itemsize))
    chunk = min(T, chunk_rows or max(1, CHUNK_BYTES.get(device.type, 1 << 28) // per_row))
    # [N, H, G, T, D], cast to the keys' dtype, then scaled
    Q = (torch.stack(queries).to(keys.dtype) * D**-0.5).view(N, T, H, G, D).permute(0, 2, 3, 1, 4).contiguous()
    q_pos_dev = q_pos.to(device)  # once: a copy from pageable memory waits for the stream
    (init_lo, init_hi), (recent_lo, recent_hi) = ir_regions
    buffers: dict[int, torch.Tensor] = {}
    for h0 in range(0, H, Hg):
        k_pass = keys.heads(h0, h0 + Hg)
        for start in range(0, T, chunk):
            c = min(chunk, T - start)
            qp_dev = q_pos_dev[start : start + c]
            first_masked = int(q_pos[start : start + c].min()) + 1  # columns before it: visible to every row
            q = Q[:, h0 : h0 + Hg, :, start : start + c].reshape(N, Hg, G * c, D)
            out = None
            if in_place or not keys.full:
                if c not in buffers:
                    buffers[c] = torch.empty(N, Hg * G, c, P, dtype=torch.float32, device=device)
                out = buffers[c]
            if keys.full:
                x = _full_rows(q, k_pass, c, first_masked, qp_dev, out)
            else:
                x = _layer_rows(q, k_pass, c, first_masked, qp_dev, out)
            ir_mass += (x[..., init_lo:init_hi].sum((1, 2, 3)) + x[..., recent_lo:recent_hi].sum((1, 2, 3))).double()
            flat = x.view(N, Hg * G, c * P).transpose(0, 1)  # [Hg * G, N, c * P], a strided view (no copy)
            gram[h0 * G : (h0 + Hg) * G].baddbmm_(flat, flat.transpose(1, 2))  # every head, every layer pair
            del x, flat  # before the next chunk's scores: at most one chunk's rows at a time
    return gram, ir_mass


def _full_rows(q: torch.Tensor, k: torch.Tensor, c: int, first: int, q_pos: torch.Tensor,
               out: torch.Tensor | None) -> torch.Tensor:
    """Attention rows [N, Hg * G, c, P] (fp32) of scaled queries q [N, Hg, G * c, D] over keys
    k [N, Hg, P, D] at positions 0..P-1, causal by q_pos [c] (on the device). out: an fp32 buffer
    [N, Hg * G, c, P] the fp32 scores go straight into (softmax in place); None: scores in the keys'
    dtype, then an fp32 softmax."""
    N, Hg, GC, D = q.shape
    P = k.shape[2]
    G = GC // c
    qf, kf = q.view(N * Hg, GC, D), k.reshape(N * Hg, P, D)
    if out is not None:
        torch.matmul(qf, kf.transpose(1, 2), out=out.view(N * Hg, GC, P))
        _mask_future(out.view(-1, c, P), first, q_pos)
        out.sub_(out.amax(-1, keepdim=True)).exp_()
        return out.div_(out.sum(-1, keepdim=True))
    scores = torch.matmul(qf, kf.transpose(1, 2))
    _mask_future(scores.view(-1, c, P), first, q_pos)
    return torch.softmax(scores.view(N, Hg * G, c, P), dim=-1, dtype=torch.float32)


def _layer_rows(q: torch.Tensor, k_pass: list, c: int, first: int, q_pos: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
    """As _full_rows, into x [N, Hg * G, c, P], one layer at a time, for keys a head of which may not
    hold every position: k_pass per layer (k [Hg, S, D], positions [Hg, S], validity [Hg, S]).
    Columns are key positions: a layer's rows are scattered to its keys' positions."""
    Hg, GC, D = q.shape[1:]
    P = x.shape[-1]
    G = GC // c
    for layer, (k, kpos, valid) in enumerate(k_pass):
        out = x[layer].view(Hg, G, c, P)
        if kpos is None and k.dtype == torch.float32:
            # Keys at positions 0..P-1 in fp32 (the CPU): scores straight into the buffer, softmax in place.
            torch.matmul(q[layer], k.transpose(1, 2), out=out.view(Hg, GC, P))
            _mask_future(out, first, q_pos)
            out.sub_(out.amax(-1, keepdim=True)).exp_()
            out.div_(out.sum(-1, keepdim=True))
        elif kpos is None:  # bf16/fp16 score GEMM (the GPU), fp32 softmax
            scores = torch.matmul(q[layer], k.transpose(1, 2)).view(Hg, G, c, P)
            _mask_future(scores, first, q_pos)
            out.copy_(torch.softmax(scores, dim=-1, dtype=torch.float32))
        else:  # evicted heads: mask what a head does not hold, scatter rows to key positions
            scores = torch.matmul(q[layer], k.transpose(1, 2)).view(Hg, G, c, -1)
            visible = valid[:, None, None, :] & (kpos[:, None, None, :] <= q_pos[None, None, :, None])
            w = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32)
            w = w.nan_to_num_(0.0) * visible  # a head that sees nothing contributes nothing
            out.zero_().scatter_add_(-1, kpos.clamp(max=P - 1)[:, None, None, :].expand_as(w), w)
    return x


def _mask_future(scores: torch.Tensor, first: int, q_pos: torch.Tensor) -> None:
    """-inf on the columns (positions) after each row's own position; only columns >= first can be."""
    P = scores.shape[-1]
    if first < P:
        future = torch.arange(first, P, device=scores.device)[None, :] > q_pos[:, None]  # [c, P - first]
        scores[..., first:].masked_fill_(future, float("-inf"))


def ir_regions(num_positions: int, share: float = 0.1) -> tuple[tuple[int, int], tuple[int, int]]:
    """The first and last `share` of positions, disjoint even for short sequences."""
    n = max(1, round(share * num_positions))
    n = min(n, num_positions // 2) or 1
    return (0, n), (max(n, num_positions - n), num_positions)


def sample_rows(num_rows: int, max_rows: int | None, seed: int = 0) -> torch.Tensor | None:
    """Indices of max_rows rows evenly spaced over the turn from a seeded random offset (systematic
    sampling: every row is equally likely, and neighbouring rows, which look alike, are not drawn
    together), or None to keep them all. On SmolLM2 it matched the exact pairs more often than a
    uniform random subset of the same size (tests/state/test_estimator.py)."""
    if max_rows is None or num_rows <= max_rows:
        return None
    offset = torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ((torch.arange(max_rows, dtype=torch.float64) + offset) * (num_rows / max_rows)).long().clamp(max=num_rows - 1)


def attention_statistics(seq, queries: list[torch.Tensor], positions: torch.Tensor, is_decode: torch.Tensor,
                         share: float = 0.1, where: str = "auto", max_rows: int | None = None,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ir_score [N] in [0, 1], distance [N, N]) over the turn's attention rows; ir_score is the mean
    over query heads and rows of the mass on the first and last `share` of the positions, distance
    the per-head Euclidean distance between two layers' maps, averaged over heads.
    where: "device", "cpu" (the paper's split) or "auto" (device on a GPU, else cpu);
    max_rows: sample at most this many rows (seeded), scaling the squared distances back up."""
    device = seq.pool.device
    P = seq.next_position
    regions = ir_regions(P, share)
    if where == "auto":
        where = "device" if device.type == "cuda" else "cpu"
    if where not in ("device", "cpu"):
        raise ValueError(f"where is device, cpu or auto, not {where!r}")
    positions, is_decode = positions.cpu(), is_decode.cpu()
    total_rows = len(positions)
    pick = sample_rows(total_rows, max_rows, seed)
    scale = 1.0
    if pick is not None:
        queries = [q[pick.to(q.device)] for q in queries]
        positions, is_decode = positions[pick], is_decode[pick]
        scale = total_rows / len(pick)

    def part(mask, where_to: torch.device, keys: _Keys):
        qs = [q[mask.to(q.device)].to(where_to) for q in queries]
        return _accumulate(qs, positions[mask], keys, P, regions)

    dtype = seq.pool.dtype if device.type == "cuda" else torch.float32  # bf16 score GEMMs on the GPU
    if where == "device":
        gram, ir = _accumulate([q.to(device) for q in queries], positions, _Keys(seq, device, dtype), P, regions)
    else:
        # The keys are made here, not in the worker: making them reads the sequence, which is not thread-safe.
        device_keys = _Keys(seq, device, dtype)
        cpu = torch.device("cpu")
        cpu_keys = device_keys if device.type == "cpu" else _Keys(seq, cpu, torch.float32)
        # Prefill rows on a CPU worker, decode rows on the device, at the same time.
        with ThreadPoolExecutor(1) as pool:
            cpu_part = pool.submit(part, ~is_decode, cpu, cpu_keys)
            gram_d, ir_d = part(is_decode, device, device_keys)
            gram_p, ir_p = cpu_part.result()
        gram, ir = gram_p + gram_d.cpu(), ir_p + ir_d.cpu()
    gram, ir = gram.cpu(), ir.cpu()
    norms = torch.diagonal(gram, dim1=1, dim2=2)  # [Hq, N]
    sq = (norms[:, :, None] + norms[:, None, :] - 2 * gram).clamp_min(0)  # cancellation can go below 0
    per_head = (scale * sq).sqrt()  # [Hq, N, N]
    heads, shard = queries[0].shape[1], seq.pool.shard
    if shard is None:
        distance = per_head.mean(0)
    else:  # tensor parallel: the sums over every rank's query heads (each query head is on one rank)
        summed = all_reduce(torch.cat([per_head.sum(0).double().flatten(), ir.double()]).to(device), shard).cpu()
        heads, N = shard.config.num_heads, len(ir)
        distance, ir = (summed[: N * N].view(N, N) / heads).to(per_head.dtype), summed[N * N :].to(ir.dtype)
    rows = max(1, len(positions)) * heads
    return (ir / rows).float(), distance
