"""How a recipe's prefill pattern reaches the engine, and the per-turn statistics it leaves.

The recipe's prefill component is shared by every conversation that uses it; PatternHook binds it to
one conversation's MethodState, so the statistics of each layer land with that conversation. The
engine's Step calls the hook per layer with the chunk's queries and keys (lines.Keys); the hook
returns the attention output [B, Hq, T, D]."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from turnkv.attention import lines
from turnkv.attention.lines import Keys


# A stage's time on a GPU needs the device synchronized at its edges, which stops the host from
# queueing the next layer while this one runs (every prefill slice of a server would pay it). So on a
# GPU the patterns' stage times are taken only with TURNKV_STAGE_TIMES=1; off a GPU they are free.
STAGE_TIMES = os.environ.get("TURNKV_STAGE_TIMES", "0") == "1"


def clock(device: torch.device, sync: bool | None = None) -> float | None:
    """Seconds, after the device's queued work. sync None: on a GPU only with STAGE_TIMES (else None);
    True: always after the queued work; False: the host's time, never waiting (a method's own
    `profile` option decides, as LoopServe's does)."""
    if device.type == "cuda" and sync is not False:
        if not (sync or STAGE_TIMES):
            return None
        torch.cuda.synchronize(device)
    return time.perf_counter()


def since(t0: float | None, device: torch.device) -> float | None:
    """Seconds from clock()'s t0 to now (None when stage times are not taken)."""
    now = clock(device)
    return None if t0 is None or now is None else now - t0


def fixed_pattern(layer: int, keys: Keys, mask_fn, lines_fn=None) -> tuple[torch.Tensor, dict]:
    """Attention of a pattern that needs no selection (A-shape, Tri-shape, streaming heads), with its
    statistics. mask_fn(rows) -> [B, U, R, S] gives its cells; lines_fn() -> (vertical, slash,
    per_query_head) the same cells as lines, for the Triton line kernel where it runs (CUDA). Off CUDA
    the mask path runs as it always did, and the lines are never built."""
    t0 = clock(keys.q.device)
    if lines_fn is not None and lines.uses_kernel(keys.q.device):
        out, computed, causal = lines.line_attention(keys, *lines_fn(), mask_fn=mask_fn)
    else:
        out, computed, causal = lines.blockwise_attention(keys, mask_fn)
    return out, with_times(dict(layer=layer, computed=computed, causal=causal),
                       time_sparse_attention=since(t0, keys.q.device))


def with_times(stats: dict, **times) -> dict:
    """stats with the stage times that were taken (since() gives None for the others)."""
    return {**stats, **{k: v for k, v in times.items() if v is not None}}


class PatternHook:
    def __init__(self, method, sink: list):
        self.method, self.sink = method, sink

    def __call__(self, layer: int, keys: Keys) -> torch.Tensor:
        out, stats = self.method.attend(layer, keys)
        self.sink.append(stats)
        return out

    def chunk_windows(self, seqs, num_new: int):
        """The method's ChunkWindows (Prefill.chunk_windows), or None. When given, the chunk's cells
        are recorded here for every layer, as `attend` would have."""
        windows = self.method.chunk_windows(seqs, num_new)
        if windows is not None:
            for layer in range(windows.computed.shape[0]):
                self.sink.append({"layer": layer, "computed": torch.from_numpy(windows.computed[layer]),
                                  "causal": torch.from_numpy(windows.causal[layer])})
        return windows


def on_host(stats: list[dict]) -> list[dict]:
    """The entries with their device tensors on the host, read back in one copy: a prompt of 8 chunks
    over 32 layers leaves 256 entries, and a read per entry and key waits for the device each time."""
    found = [(i, key) for i, entry in enumerate(stats) for key, value in entry.items()
             if isinstance(value, torch.Tensor) and value.device.type != "cpu"]
    if not found:
        return stats
    # float64 holds every count (below 2**53), bool and float32 mass exactly.
    flat = torch.cat([stats[i][key].reshape(-1).to(torch.float64) for i, key in found]).cpu()
    out, offset = [dict(entry) for entry in stats], 0
    for i, key in found:
        t = stats[i][key]
        out[i][key] = flat[offset : offset + t.numel()].view(t.shape).to(t.dtype)
        offset += t.numel()
    return out


def summarise(stats: list[dict], num_layers: int) -> dict:
    """One turn's layer entries (several per layer when the prompt was prefilled in chunks) ->
    density (computed / causal cells over every layer, head and chunk), per-layer density, the share
    of units that computed every causal cell of their chunk (dense_per_layer over the (chunk, sequence,
    unit) entries of a layer, dense_share over all: LoopServe's heads that went dense), lines per head
    (summed over chunks), the mass recovered on the sample (LoopServe), and seconds per stage."""
    stats = on_host(stats)
    computed = np.zeros(num_layers)
    causal = np.zeros(num_layers)
    dense = np.zeros(num_layers)  # units with every causal cell computed, per layer
    units = np.zeros(num_layers)  # units with at least one causal cell, per layer
    out: dict = {}
    per_layer: dict[str, list] = {}
    times: dict[str, float] = {}
    recovered, estimated = [], []
    for entry in stats:
        layer = entry["layer"]
        computed[layer] += float(entry["computed"].sum())
        causal[layer] += float(entry["causal"].sum())
        unit_cells = torch.as_tensor(entry["causal"]).cpu().double()  # [B, U]
        has_cells = unit_cells > 0
        dense[layer] += float((has_cells & (torch.as_tensor(entry["computed"]).cpu().double() >= unit_cells)).sum())
        units[layer] += float(has_cells.sum())
        for kind in ("vertical", "slash"):
            if kind in entry:
                counts = per_layer.setdefault(kind, [None] * num_layers)
                value = entry[kind].cpu().numpy().astype(np.int64)
                counts[layer] = value if counts[layer] is None else counts[layer] + value
        if "recovered" in entry:
            recovered.append(entry["recovered"].float().cpu().numpy())
            estimated.append(entry["estimated"].float().cpu().numpy())
        for key, value in entry.items():
            if key.startswith("time_") and value is not None:
                times[key] = times.get(key, 0.0) + value
    out["density"] = float(computed.sum() / max(causal.sum(), 1))
    out["density_per_layer"] = (computed / np.maximum(causal, 1)).tolist()
    out["dense_per_layer"] = (dense / np.maximum(units, 1)).tolist()
    out["dense_share"] = float(dense.sum() / max(units.sum(), 1))
    for kind, counts in per_layer.items():
        # [layers][batch][heads] -> [layers][heads] for the single sequence a prefill runs
        out[f"{kind}_lines"] = [c[0].tolist() if c is not None else None for c in counts]
    if "vertical" in per_layer and "slash" in per_layer:
        out["lines_per_head"] = [(v[0] + s[0]).tolist() if v is not None else None
                                 for v, s in zip(per_layer["vertical"], per_layer["slash"])]
    if recovered:
        out["recovered_mass"] = float(np.mean([r.mean() for r in recovered]))
        out["recovered_mass_min"] = float(min(r.min() for r in recovered))
        out["estimated_mass"] = float(np.mean([e.mean() for e in estimated]))
    out.update(times)
    return out
