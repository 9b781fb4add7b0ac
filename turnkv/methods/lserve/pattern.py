"""Which (layer, KV head) pairs are streaming (sink + local window) and which are dense.

LServe/DuoAttention give every KV head a gate in [0, 1] (near 1: retrieval head, near 0: streaming
head) and keep a head dense iff its gate is >= the `sparsity` quantile of ALL gates of the model,
so the number of dense heads varies per layer. Granularity is per KV head: one flag
covers the head's whole GQA group of query heads.

Files:
- JSON (`save_json`/`load_json`): our format, with the flags, the gates they came from and metadata.
- TSV (`save_tsv`/`load_tsv`): `[layers x kv_heads]` of 1 (dense) / 0 (streaming), tab separated.
- DuoAttention release (`load_duo_attention`): `full_attention_heads.tsv`, a tab-separated matrix
  of float gates, thresholded here at the quantile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "turnkv-head-pattern"
DUO_FILE = "full_attention_heads.tsv"


class PatternFileError(ValueError):
    """A pattern file that cannot be read, with the path and what is wrong in the message."""


@dataclass
class HeadPattern:
    """streaming[layer, kv_head] = True for a streaming head. `gates` keeps the scores it came from."""

    streaming: np.ndarray
    gates: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.streaming = np.asarray(self.streaming)
        if self.streaming.ndim != 2 or 0 in self.streaming.shape:
            raise ValueError(f"a head pattern is [layers x kv_heads], got shape {self.streaming.shape}")
        if self.streaming.dtype != bool:
            if not np.isin(self.streaming, (0, 1)).all():
                raise ValueError("streaming flags must be booleans or 0/1")
            self.streaming = self.streaming.astype(bool)
        if self.gates is not None:
            self.gates = np.asarray(self.gates, dtype=np.float64)
            if self.gates.shape != self.streaming.shape:
                raise ValueError(f"gates {self.gates.shape} and flags {self.streaming.shape} differ in shape")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gates(cls, gates, sparsity: float = 0.5, seed: int = 0, meta: dict | None = None) -> HeadPattern:
        """Dense iff gate >= quantile(all gates, sparsity): `sparsity` is the streaming fraction.

        Gates are clipped to [0, 1] and get U(0, 1e-6) noise so that ties (many gates at exactly 1)
        split at the requested ratio, as DuoAttention does. 0 -> all dense, >= 1 -> all streaming."""
        gates = np.asarray(gates, dtype=np.float64)
        if gates.ndim != 2 or 0 in gates.shape:
            raise ValueError(f"gates must be a [layers x kv_heads] matrix, got shape {gates.shape}")
        if not np.isfinite(gates).all():
            raise ValueError("gates must be finite numbers")
        if not 0.0 <= sparsity:
            raise ValueError(f"sparsity is a fraction of streaming heads in [0, 1], got {sparsity}")
        noisy = np.clip(gates, 0.0, 1.0) + np.random.default_rng(seed).uniform(0.0, 1e-6, gates.shape)
        if sparsity >= 1.0:
            streaming = np.ones(gates.shape, dtype=bool)
        else:
            streaming = noisy < np.quantile(noisy, sparsity)
        return cls(streaming, gates, {"sparsity": float(sparsity), **(meta or {})})

    @classmethod
    def random(cls, num_layers: int, num_kv_heads: int, sparsity: float = 0.5, seed: int = 0) -> HeadPattern:
        """A random pattern at the ratio (speed runs, where which heads stream does not matter), spread
        evenly over the layers: round(sparsity x layers x heads) streaming heads in all, each layer
        holding the same count or one more. The page pool is per layer, so a layer with more dense
        heads than the others fills first; an even spread keeps the whole pool's saving."""
        rng = np.random.default_rng(seed)
        total = int(round(min(max(sparsity, 0.0), 1.0) * num_layers * num_kv_heads))
        counts = np.full(num_layers, total // num_layers)
        counts[rng.permutation(num_layers)[: total % num_layers]] += 1
        gates = rng.uniform(size=(num_layers, num_kv_heads))
        streaming = np.zeros((num_layers, num_kv_heads), dtype=bool)
        for layer, count in enumerate(counts):
            streaming[layer, np.argsort(gates[layer])[:count]] = True  # the lowest gates stream
        return cls(streaming, gates, {"sparsity": float(sparsity), "source": "random"})

    # ---- queries --------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.streaming.shape)

    @property
    def dense(self) -> np.ndarray:
        return ~self.streaming

    def streaming_fraction(self) -> float:
        return float(self.streaming.mean())

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        if self.shape != (num_layers, num_kv_heads):
            raise ValueError(f"head pattern is {self.shape[0]}x{self.shape[1]} but the model has "
                             f"{num_layers} layers x {num_kv_heads} KV heads")

    def query_head_mask(self, layer: int, group_size: int) -> np.ndarray:
        """Per query head of `layer`: True where streaming (the KV head's flag repeated over its group)."""
        return np.repeat(self.streaming[layer], group_size)

    # ---- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": 1, "num_layers": self.shape[0], "num_kv_heads": self.shape[1],
                "streaming": self.streaming.astype(int).tolist(),
                "gates": None if self.gates is None else self.gates.tolist(), "meta": self.meta}

    def save_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load_json(cls, path) -> HeadPattern:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PatternFileError(f"{path}: not a readable JSON head pattern ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PatternFileError(f"{path}: not a {FORMAT} file (missing or wrong 'format')")
        try:
            pattern = cls(np.asarray(data["streaming"]), None if data.get("gates") is None else
                          np.asarray(data["gates"], dtype=np.float64), data.get("meta") or {})
        except (KeyError, ValueError, TypeError) as e:
            raise PatternFileError(f"{path}: {e}") from None
        if pattern.shape != (data.get("num_layers"), data.get("num_kv_heads")):
            raise PatternFileError(f"{path}: flags are {pattern.shape} but the header says "
                                   f"{data.get('num_layers')}x{data.get('num_kv_heads')}")
        return pattern

    def save_tsv(self, path) -> None:
        """1 = dense, 0 = streaming (the DuoAttention convention: 1 = full attention)."""
        rows = ["\t".join(str(int(d)) for d in row) for row in self.dense]
        Path(path).write_text("\n".join(rows) + "\n")

    @classmethod
    def load_tsv(cls, path) -> HeadPattern:
        values = _read_matrix(path)
        if not np.isin(values, (0.0, 1.0)).all():
            raise PatternFileError(f"{path}: a pattern TSV holds 0/1 flags; for DuoAttention gate values "
                                   f"use load_duo_attention(path, sparsity)")
        return cls(values == 0.0, None, {"source": str(path)})

    @classmethod
    def load(cls, path) -> HeadPattern:
        """By extension: .json (ours) or .tsv (0/1 flags)."""
        suffix = Path(path).suffix.lower()
        if suffix == ".json":
            return cls.load_json(path)
        if suffix == ".tsv":
            return cls.load_tsv(path)
        raise PatternFileError(f"{path}: a head pattern is a .json or .tsv file")


def load_duo_attention(path, sparsity: float = 0.5, num_layers: int | None = None,
                       num_kv_heads: int | None = None, seed: int = 0) -> HeadPattern:
    """A DuoAttention release: `full_attention_heads.tsv` (or the folder holding it), float gates
    [layers x kv_heads], tab separated. Heads at or above the `sparsity` quantile stay dense."""
    path = Path(path)
    if path.is_dir():
        path = path / DUO_FILE
    gates = _read_matrix(path)
    if num_layers is not None and gates.shape != (num_layers, num_kv_heads):
        raise PatternFileError(f"{path}: gates are {gates.shape[0]}x{gates.shape[1]} but the model has "
                               f"{num_layers} layers x {num_kv_heads} KV heads")
    return HeadPattern.from_gates(gates, sparsity, seed, {"source": str(path), "format": "duo-attention"})


def _read_matrix(path) -> np.ndarray:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PatternFileError(f"{path}: cannot read ({e})") from None
    rows = [line.split() for line in text.splitlines() if line.strip()]
    if not rows:
        raise PatternFileError(f"{path}: empty file")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        bad = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
        raise PatternFileError(f"{path}: row {bad + 1} has {len(rows[bad])} values, row 1 has {len(rows[0])}")
    try:
        values = np.array([[float(x) for x in r] for r in rows])
    except ValueError as e:
        raise PatternFileError(f"{path}: {e}") from None
    if not np.isfinite(values).all():
        raise PatternFileError(f"{path}: values must be finite")
    return values
