"""Krul's token-wise heterogeneous attention similarity estimator, with the spec's deviation.

Krul needs, per conversation, each layer's I-R score (attention mass on the first and last 10% of
the tokens) and the Euclidean distance between every two layers' attention maps, per head. The paper
copies each prefill map to the CPU while the GPU decodes, and folds each decode row in on the GPU.
Full maps are O(s^2) per head (~33 GB for 4K tokens on a 7B model), so turnkv follows the spec's
proposed deviation (krul.md §6.3 (ii)), and it is the default: the engine records the turn's post-RoPE
queries (TurnQueries), and at turn end the attention rows are recomputed from them in query chunks,
against the keys the conversation holds. Memory stays O(layers x heads x chunk x s).

The split is kept: prefill rows (large, one pass) go to a CPU worker thread with the Gram form
||a||^2 + ||b||^2 - 2ab (one GEMM per head gives every layer pair), while decode rows (one per step)
are folded in on the device at the same time. Because the two row blocks are disjoint rows of one
causal map, their squared distances add up to the exact distance of the whole map (spec A3).
Columns are key positions, so layers that evicted different tokens are still comparable.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from turnkv.engine.observe import QueryWindow

CHUNK_ELEMENTS = 1 << 24  # attention-row elements per chunk, over all layers and heads


class TurnQueries(QueryWindow):
    """A QueryWindow (the eviction methods' observation window, when they have one) that also keeps
    every query of the current turn, per layer, split into prefill (T > 1) and decode records."""

    def __init__(self, num_layers: int, size: int):
        super().__init__(num_layers, size)
        self.turn: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]

    def _file(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        if self.size:
            super()._file(layer, q, positions)
        self.turn[layer].append((q.detach().clone(), positions.clone()))

    def truncate(self, num_positions: int) -> None:
        super().truncate(num_positions)  # files what is pending first
        self.turn = [[(q[p < num_positions], p[p < num_positions]) for q, p in layer] for layer in self.turn]

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
        positions = torch.cat([p for _, p in records]) if records else torch.zeros(0, dtype=torch.int64)
        is_decode = torch.cat([torch.full((len(p),), len(p) == 1) for _, p in records]) if records else torch.zeros(0, dtype=torch.bool)
        queries = [torch.cat([q for q, _ in layer]) if layer else None for layer in self.turn]
        self.turn = [[] for _ in self.turn]
        return queries, positions, is_decode


def _layer_keys(seq, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, _, pos = seq.gather(layer)
    valid = torch.arange(pos.shape[1], device=pos.device)[None] < torch.from_numpy(seq.lengths[layer]).to(pos.device)[:, None]
    return k.to(device), pos.to(device), valid.to(device)


def _accumulate(queries, q_pos, keys, num_positions: int, ir_regions, chunk_rows: int | None = None):
    """Gram matrices [Hq, N, N] of the attention rows of `queries` (per layer [T, Hq, D]) over the
    layers' keys, and the I-R mass per layer [N] (summed over heads and rows)."""
    N = len(queries)
    T, Hq, D = queries[0].shape
    device = queries[0].device
    gram = torch.zeros(Hq, N, N, dtype=torch.float32, device=device)
    ir_mass = torch.zeros(N, dtype=torch.float64, device=device)
    if T == 0:
        return gram, ir_mass
    P = num_positions
    chunk = chunk_rows or max(1, CHUNK_ELEMENTS // (N * Hq * P))
    (init_lo, init_hi), (recent_lo, recent_hi) = ir_regions
    for start in range(0, T, chunk):
        rows = slice(start, min(T, start + chunk))
        qp = q_pos[rows]
        maps = []
        for layer in range(N):
            k, kpos, valid = keys[layer]
            H = k.shape[0]
            q = queries[layer][rows].float().transpose(0, 1).reshape(H, Hq // H, -1, D)  # [H, G, c, D]
            scores = torch.einsum("hgcd,hsd->hgcs", q, k.float()) * D**-0.5
            visible = valid[:, None, None, :] & (kpos[:, None, None, :] <= qp[None, None, :, None])
            w = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
            dense = torch.zeros(H, Hq // H, w.shape[2], P, device=device)
            dense.scatter_add_(-1, kpos.clamp(max=P - 1)[:, None, None, :].expand_as(w), w * visible)
            dense = dense.reshape(Hq, -1, P)
            ir_mass[layer] += (dense[..., init_lo:init_hi].sum() + dense[..., recent_lo:recent_hi].sum()).double()
            maps.append(dense.reshape(Hq, -1))
        x = torch.stack(maps, dim=1)  # [Hq, N, c*P]
        gram += x @ x.transpose(1, 2)
    return gram, ir_mass


def ir_regions(num_positions: int, share: float = 0.1) -> tuple[tuple[int, int], tuple[int, int]]:
    """The first and last `share` of positions, disjoint even for short sequences (spec A2)."""
    n = max(1, int(round(share * num_positions)))
    n = min(n, num_positions // 2) or 1
    return (0, n), (max(n, num_positions - n), num_positions)


def attention_statistics(seq, queries: list[torch.Tensor], positions: torch.Tensor, is_decode: torch.Tensor,
                         share: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ir_score [N] in [0, 1], distance [N, N]) over the turn's attention rows; ir_score is the mean
    over query heads and rows of the mass on the first and last `share` of the positions, distance
    the per-head Euclidean distance between two layers' maps, averaged over heads."""
    N = len(queries)
    device = seq.pool.device
    P = seq.next_position
    regions = ir_regions(P, share)
    prefill, decode = ~is_decode, is_decode

    # Keys are gathered here, not in the worker: the sequence is not thread-safe.
    device_keys = [_layer_keys(seq, layer, device) for layer in range(N)]
    cpu_keys = [tuple(t.cpu() for t in k) for k in device_keys] if device.type != "cpu" else device_keys
    cpu_queries = [(q[prefill.to(q.device)]).cpu() for q in queries]

    def part(qs, keys, mask, where):
        return _accumulate(qs, positions[mask].to(where), keys, P, regions)

    # Prefill rows on a CPU worker, decode rows on the device, at the same time.
    with ThreadPoolExecutor(1) as pool:
        cpu_part = pool.submit(part, cpu_queries, cpu_keys, prefill, torch.device("cpu"))
        gram_d, ir_d = part([q[decode.to(q.device)].to(device) for q in queries], device_keys, decode, device)
        gram_p, ir_p = cpu_part.result()
    gram = gram_p + gram_d.cpu()
    norms = torch.diagonal(gram, dim1=1, dim2=2)  # [Hq, N]
    sq = (norms[:, :, None] + norms[:, None, :] - 2 * gram).clamp_min(0)  # cancellation can go below 0
    distance = sq.sqrt().mean(0)
    rows = max(1, len(positions)) * queries[0].shape[1]
    ir_score = ((ir_p + ir_d.cpu()) / rows).float()
    return ir_score, distance
