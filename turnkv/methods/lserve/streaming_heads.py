"""Static sparsity (DuoAttention, LServe): streaming KV heads see only sink + local tokens.

Per (layer, KV head) a HeadPattern says which heads stream. This component is the recipe's prefill
axis `streaming_heads` and also owns what streaming heads keep: in prefill they attend to keys
< sink or within `prefill_local` of the row; in the store each is its sink plus a ring of whole pages,
trimmed after every prefill slice and decode step (`trim`, host-only: it edits page tables and returns
pages to the pool) to sink + the last `local` .. `local + page_size - 1` tokens (`prefill_local` ..
while more of the prompt is to come, so a prompt prefilled in slices attends as in one pass). Heads something else
moved (eviction, a restore; not a rollback, which only cuts the newest tokens) are checked once and
trimmed exactly. Prefill chunks run on the engine's paths with a window per head (`chunk_windows`)
where the heads are in ring form: the windowed chunk kernel for short chunks, else the dense heads on
the dense paths and the streaming heads on attention/streaming.py's block decomposition. The design, its parameters and
measurements: docs/methods/lserve.md.

Patterns: `pattern=None` thresholds the calibrated SmolLM2 gates (DEFAULT_PATTERN) at `ratio`;
`pattern="random"` draws one at `ratio`; a path loads a JSON/TSV pattern file, or a DuoAttention
release (`full_attention_heads.tsv` or its folder) thresholded at `ratio`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from turnkv.attention import lines, reference
from turnkv.attention.lines import Keys
from turnkv.attention.reference import gather_pages
from turnkv.errors import InvalidRequestError
from turnkv.gpu import upload
from turnkv.methods.lserve.pattern import DUO_FILE, HeadPattern, PatternFileError, load_duo_attention
from turnkv.methods.prefill.a_shape import a_shape_lines, a_shape_mask
from turnkv.methods.prefill.pattern_hook import clock, fixed_pattern, since, with_times
from turnkv.methods.protocols import NO_WINDOW, ChunkWindows, Prefill, StaticSparsity
from turnkv.methods.registry import build, register
from turnkv.methods.terms import parse_term
from turnkv.paths import user_path

# The calibrated SmolLM2-135M gates, shipped as package data (benchmarks/sparse/lserve_calibrate.py made it).
DEFAULT_PATTERN = Path(__file__).resolve().parent / "patterns" / "smollm2_135m.json"


@register("prefill", "streaming_heads")
@dataclass
class StreamingHeadsPrefill(Prefill, StaticSparsity):
    """DuoAttention/LServe streaming heads: sink + local for the pattern's streaming KV heads, dense elsewhere.

    pattern: a pattern file, "random", or None (calibrated SmolLM2 gates). ratio: streaming fraction
    for gates (None: the file's flags, 0.5 otherwise). sink / local: what streaming heads keep and
    decode reads (128 / 256; the ring holds local .. local + page_size - 1 recent tokens).
    prefill_local: their window in prefill (8192). dense: a prefill pattern for the dense heads, as
    a recipe term (loopserve, minference(vertical=500), a_shape(local=2048), ...), composed with the streaming
    heads as LServe does past 128K: the dense heads' queries and keys go to that method alone, which
    selects and attends over them (its lines on the line kernel); None: full attention."""

    # Parameters whose value names a file, with the values that do not (Recipe.with_named_files).
    file_params: ClassVar[dict[str, tuple]] = {"pattern": (None, "random")}

    pattern: str | None = None
    ratio: float | None = None
    sink: int = 128
    local: int = 256
    prefill_local: int = 8192
    dense: str | None = None
    _flags: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _dense_method: object = field(default=None, init=False, repr=False, compare=False)
    # Per SequenceKV: its `_reorders` when its streaming heads were last known to be sink + ring (-1: a
    # head that is not). A SequenceKV not in it has only been appended to or cut where they are 0.
    _rings: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, init=False,
                                              repr=False, compare=False)

    def __post_init__(self):
        if self.sink < 0 or self.local < 1 or self.prefill_local < self.local:
            raise ValueError("need sink >= 0, local >= 1 and prefill_local >= local")
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio is the streaming fraction in [0, 1], got {self.ratio}")
        if self.dense is not None:
            name, params = parse_term(self.dense)
            if name == "streaming_heads":
                raise ValueError("dense names the dense heads' pattern; streaming_heads cannot nest")
            self._dense_method = build("prefill", name, params)

    @property
    def path_independent(self) -> bool:
        """Streaming heads attend and keep by position alone; a `dense` method may estimate its
        pattern from a chunk's queries, and is then path-independent only if it says so."""
        return self._dense_method is None or self._dense_method.path_independent

    # ---- the pattern ----------------------------------------------------------------------------
    def flags(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
        """[layers, kv_heads] bool, True = streaming; loaded once per model shape. Under tensor
        parallelism (bind's shard), the rank's KV heads' columns of the whole model's pattern."""
        shard = getattr(self, "_shard", None)
        if shard is not None and num_kv_heads != shard.config.num_kv_heads:
            # C order: a column selection comes out column-major, and its rows would be strided.
            return np.ascontiguousarray(self.flags(num_layers, shard.config.num_kv_heads)[:, shard.kv_heads])
        shape = (num_layers, num_kv_heads)
        if shape not in self._flags:
            pattern = self._load(*shape)
            try:
                pattern.check_model(*shape)
            except ValueError as e:
                raise InvalidRequestError(f"streaming_heads: {e}; give pattern=<file> for this model "
                                          f"or pattern=random") from None
            self._flags[shape] = pattern.streaming.copy()
        return self._flags[shape]

    def _load(self, num_layers: int, num_kv_heads: int) -> HeadPattern:
        ratio = 0.5 if self.ratio is None else self.ratio
        if self.pattern == "random":
            return HeadPattern.random(num_layers, num_kv_heads, ratio)
        path = user_path(self.pattern) if self.pattern is not None else DEFAULT_PATTERN
        try:
            if path.is_dir() or path.name == DUO_FILE:
                return load_duo_attention(path, ratio)
            pattern = HeadPattern.load(path)
        except PatternFileError as e:
            raise InvalidRequestError(f"streaming_heads: {e}") from None
        if (self.ratio is not None or self.pattern is None) and pattern.gates is not None:
            pattern = HeadPattern.from_gates(pattern.gates, ratio, meta=pattern.meta)
        return pattern

    # ---- prefill ----------------------------------------------------------------------------------
    def attend(self, layer: int, keys: Keys, force_triton: bool = False):
        flags = self._layer_flags(layer, keys.k.shape[1])
        if self._dense_method is not None and not flags.all():
            if keys.window is not None:
                raise InvalidRequestError("streaming_heads(dense=...) does not support sliding-window models")
            if not flags.any():
                return self._dense_method.attend(layer, keys)
            return self._attend_split(layer, keys, flags, force_triton)
        if (lines.uses_kernel(keys.q.device, force_triton) and flags.any() and not flags.all()
                and keys.valid is None and keys.window is None):
            return self._attend_split(layer, keys, flags, force_triton)
        streaming = torch.from_numpy(flags).to(keys.q.device)

        def mask(rows):
            window = a_shape_mask(keys, rows, self.sink, self.prefill_local)
            return torch.where(streaming[None, :, None, None], window, keys.visible(rows))

        def lines_fn():
            """For the line kernel (CUDA), per KV head: a streaming head's sink keys are vertical lines
            and its window the offsets < prefill_local; a dense head has every offset (dense causal)."""
            vertical, slash, _ = a_shape_lines(keys, self.sink, self.prefill_local)
            B = keys.k.shape[0]
            per_head = streaming.repeat(B)[:, None]  # units are (sequence, KV head)
            return vertical & per_head, slash | ~per_head, False

        return fixed_pattern(layer, keys, mask, lines_fn)

    def chunk_windows(self, seqs, num_new: int) -> ChunkWindows | None:
        """Streaming heads see their sink and the last `prefill_local` positions, dense heads every
        kept key: windows by position, which the engine's paged path applies to whatever is kept. The
        cells are counted on the host where every streaming head is the sink plus one run ending at
        the newest token (a ring nothing but appends and cuts touched since `trim`); otherwise None,
        and `attend` counts them. None with `dense`, whose method picks the dense heads' cells."""
        if self._dense_method is None and all(self._ring_form(kv) for kv in seqs):
            return _ring_windows(seqs, num_new, self.flags(*seqs[0].lengths.shape), self.sink, self.prefill_local)
        return None

    def paths_change_at(self) -> int:
        """Past its sink and prefill window a streaming head's rows miss kept keys: windowed chunks."""
        return self.sink + self.prefill_local + 1

    def _ring_form(self, kv) -> np.ndarray:
        known = self._rings.get(kv)
        ring = _reorders(kv) == (0 if known is None else known)
        return bool(ring[self.flags(*kv.lengths.shape)].all())

    def _attend_split(self, layer: int, keys: Keys, flags: np.ndarray, force_triton: bool):
        """Dense heads through SDPA (flash attention), streaming heads through the line kernel, where
        every head holds the same keys (a first turn's chunks, before the ring is trimmed). One kernel
        over all heads would compute the dense heads' cells with every offset selected, at the line
        kernel's per-cell cost, which is above flash attention's.
        With `dense`, that method attends the dense heads instead (any keys: it reads their `valid`)."""
        B, _, T, D = keys.q.shape
        H, G = keys.k.shape[1], keys.group
        t0 = clock(keys.q.device)
        out = torch.empty_like(keys.q)
        grouped = out.view(B, H, G, T, D)
        parts = {}
        for name, heads in (("dense", np.flatnonzero(~flags)), ("streaming", np.flatnonzero(flags))):
            idx = torch.from_numpy(heads).to(keys.q.device)
            parts[name] = (idx, replace(keys, q=keys.q.view(B, H, G, T, D)[:, idx].reshape(B, len(heads) * G, T, D),
                                        k=keys.k[:, idx], v=keys.v[:, idx], k_pos=keys.k_pos[:, idx],
                                        valid=None if keys.valid is None else keys.valid[:, idx]))
        idx, dense = parts["dense"]
        dense_stats = {}
        if self._dense_method is None:
            grouped[:, idx] = reference.causal_suffix(dense.q, dense.k, dense.v).view(B, len(idx), G, T, D)
        else:
            out_d, dense_stats = self._dense_method.attend(layer, dense)
            grouped[:, idx] = out_d.view(B, len(idx), G, T, D)
        idx, stream = parts["streaming"]
        vertical, slash, _ = a_shape_lines(stream, self.sink, self.prefill_local)
        out_s, computed, causal = lines.line_attention(
            stream, vertical, slash, False, force_triton=force_triton,
            mask_fn=lambda rows: a_shape_mask(stream, rows, self.sink, self.prefill_local))
        grouped[:, idx] = out_s.view(B, len(idx), G, T, D)
        if dense_stats:  # the dense method's own counts (its layout) beside the streaming heads'
            selecting = dense_stats.get("time_random_select", 0.0) + dense_stats.get("time_search", 0.0)
            elapsed = since(t0, keys.q.device)
            stats = with_times({**dense_stats, "layer": layer},
                           time_sparse_attention=None if elapsed is None else elapsed - selecting)
            for name, part in (("computed", computed), ("causal", causal)):
                stats[name] = torch.cat([dense_stats[name].reshape(-1).to(part.device), part.reshape(-1)])
            return out, stats
        # Counts per (sequence, KV head) in the layout the one-pass paths give; dense heads compute
        # every causal cell: T rows ending at the last of S keys.
        S = keys.k.shape[2]
        dense_cells = T * (S - T) + T * (T + 1) // 2
        counts = []
        for part in (computed, causal):
            full = torch.full((B, H), dense_cells, dtype=part.dtype, device=part.device)
            full[:, idx] = part.reshape(B, len(idx))
            counts.append(full.reshape(part.shape[:-1] + (H,)) if part.dim() > 1 else full.reshape(-1))
        return out, with_times({"layer": layer, "computed": counts[0], "causal": counts[1]},
                           time_sparse_attention=since(t0, keys.q.device))

    def bind(self, num_layers: int, shard=None) -> None:
        """The model's layer count (Recipe.new_state): a prefill chunk sees only its KV heads; and the
        tensor-parallel shard whose heads those are (None on one device)."""
        self._num_layers, self._shard = num_layers, shard

    def _layer_flags(self, layer: int, num_kv_heads: int) -> np.ndarray:
        if getattr(self, "_num_layers", None) is None:
            raise InvalidRequestError("streaming_heads: the recipe was not bound to a model (Recipe.new_state)")
        return self.flags(self._num_layers, num_kv_heads)[layer]

    # ---- the store --------------------------------------------------------------------------------
    def trim(self, kv, prompt_open: bool = False) -> None:
        """Drop the streaming heads' ring pages that lie wholly beyond the last `local` tokens (with
        prompt_open, the last `prefill_local`: what the prompt's next rows see, so a prompt prefilled
        in slices attends as one pass would).

        Host work only while every streaming head is sink + ring (a head's ring then holds
        kv.lengths - sink tokens ending at kv.next_position): which heads drop how many pages follows
        from kv.lengths alone, and nothing is read from the device."""
        local = self.prefill_local if prompt_open else self.local
        L, H = kv.lengths.shape
        streaming = self.flags(L, H)
        N, ps = kv.next_position, kv.pool.page_size
        if N <= self.sink + local:
            return  # no head holds a position in [sink, N - local): nothing can go
        known = self._rings.get(kv)
        dirty = streaming & (_reorders(kv) != (0 if known is None else known))
        if not dirty.any() and int(kv.lengths[streaming].max(initial=0)) < self.sink + local + ps:
            return  # every streaming head is sink + ring, and no ring holds a page past its window
        ring = np.ones((L, H), dtype=bool)
        if dirty.any():
            ring[dirty] = self._check(kv, dirty, local)[dirty]
        tail = kv.lengths - self.sink
        drop = streaming & ring & (tail >= local + ps)
        if drop.any():
            pages = (tail - local) // ps
            if self.sink % ps == 0:
                layers, heads = np.nonzero(drop)
                kv.drop_pages(layers, heads, self.sink // ps, pages[layers, heads])
            else:
                for layer in np.flatnonzero(drop.any(axis=1)):
                    n, first = kv.lengths[layer], self.sink + pages[layer] * ps
                    kv.keep(layer, [np.r_[0:self.sink, first[h]:n[h]] if drop[layer, h] else np.arange(n[h])
                                    for h in range(H)])
        if dirty.any() or drop.any():
            known = _reorders(kv)
            known[streaming & ~ring] = -1  # checked again at every trim
            self._rings[kv] = known

    def kept_at_most(self, prompt_open: bool, page_size: int) -> int:
        """A streaming head after `trim`: its sink and a ring of whole pages holding the last `local`
        (prompt_open: `prefill_local`) tokens and fewer than a page more."""
        return self.sink + (self.prefill_local if prompt_open else self.local) + page_size - 1

    def _check(self, kv, heads: np.ndarray, local: int) -> np.ndarray:
        """Read the positions of the layers where `heads` [L, H] are marked (one device read for all of
        them) and say per head whether it is sink + ring: positions [0, sink) then a run ending at
        next_position - 1. Heads that are not are trimmed exactly here: positions in
        [sink, next_position - local) go. Returns [L, H] bool (meaningful where `heads` is set)."""
        L, H = kv.lengths.shape
        N = kv.next_position
        layers = np.flatnonzero(heads.any(axis=1))
        positions, checks = [], []
        for layer in layers:
            S = int(kv.lengths[layer].max(initial=0))
            pos = gather_pages(kv.pool.positions[layer], kv.device_table()[layer][None], S)[0]  # [H, S]
            n = upload(kv.lengths[layer], pos.device)[:, None]
            j = torch.arange(S, device=pos.device)
            valid = j < n
            expected = torch.where(j < self.sink, j, N - n + j)
            ok = ((pos == expected) | ~valid).all(dim=1) & (n[:, 0] >= min(self.sink, N))
            gone = valid & (pos >= self.sink) & (pos < N - local)
            positions.append((valid, gone))
            checks.append(torch.stack([ok, gone.any(dim=1)]))
        ok = np.zeros((L, H), dtype=bool)
        trimmed = np.zeros((L, H), dtype=bool)
        if checks:
            both = torch.stack(checks).cpu().numpy()  # [layers, 2, H]
            ok[layers], trimmed[layers] = both[:, 0], both[:, 1]
        trimmed &= heads & ~ok
        for i, layer in enumerate(layers):
            if trimmed[layer].any():
                valid, gone = positions[i]
                gone = gone & upload(trimmed[layer], gone.device)[:, None]
                kv.keep(layer, [(valid[h] & ~gone[h]).nonzero().flatten() for h in range(H)])
        return ok


def _reorders(kv) -> np.ndarray:
    """[L, H]: the moves of each head that may have changed its positions' order or left a hole
    (SequenceKV.ordered_moves are the others). Appends and ordered moves keep a head that is the
    sink plus one run ending at the newest token in that form."""
    return kv.moves - kv.ordered_moves


def _ring_windows(seqs, T: int, streaming: np.ndarray, sink: int, local: int) -> ChunkWindows:
    """ChunkWindows of a chunk of T rows whose streaming heads ([L, H] flags) each hold positions
    [0, s0) and [N - r, N) (s0 = min(n, sink), r = n - s0, n its kept count, N next_position). Windows
    are None when no streaming head's run is longer than `local` (no row misses a kept key)."""
    lengths = np.stack([kv.lengths for kv in seqs], axis=1).astype(np.int64)  # [L, B, H]
    # Every head's T new keys are its last entries, after every kept one: T rows ending at the last of n.
    causal = (T * (lengths - T) + T * (T + 1) // 2).astype(np.float64)
    flags = np.broadcast_to(streaming[:, None, :], lengths.shape)
    n = lengths[flags]  # [X] streaming (layer, sequence, head)
    run = n - np.minimum(n, sink)
    if not (run > local).any():  # the newest row, the one that sees least far back, misses nothing
        return ChunkWindows(None, sink, causal, causal)
    N = np.broadcast_to(np.array([kv.next_position for kv in seqs])[None, :, None], lengths.shape)[flags]
    # The rows p in [N - T, N) each see min(s0, p + 1) sink keys and clamp(p + 1 - (N - run), 0, local)
    # of the run: both sums in closed form (_capped_sum), exact in integers.
    s0, first, run_start = np.minimum(n, sink), N - T, N - run
    in_sink = _capped_sum(N, s0) - _capped_sum(first, s0)
    run_seen = _capped_sum(run, local) - _capped_sum(first - run_start, local)
    computed = causal.copy()
    computed[flags] = in_sink + run_seen
    return ChunkWindows(np.where(streaming, local, NO_WINDOW), sink, computed, causal)


def _capped_sum(u: np.ndarray, cap) -> np.ndarray:
    """sum(min(i, cap) for i in 1..u), 0 where u <= 0 (int64 arrays; cap an int or an array)."""
    u = np.maximum(u, 0)
    below = np.minimum(u, cap)
    return below * (below + 1) // 2 + (u - below) * cap
