"""A SequenceKV taken out of the page pool and put back, exactly.

What a conversation's KV is, apart from its K/V rows: how many tokens each (layer, kv_head) holds,
the original position of each (not contiguous after eviction), the attention mass H2O keeps beside
them, and the next position. Rows are flattened per layer in (head, token) order, the order
SequenceKV.reserve_layout hands slots back in, so a stored layer is one contiguous tensor per kind.

Positions and masses are stored only when they carry information: a head holding 0..n-1 needs no
position list, and a mass that is all zero (no accumulating scorer) is not kept. Stored bytes are
then what a restoration strategy chose to keep, not bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnkv.gpu import upload
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.token_slots import layer_slots, token_runs


@dataclass
class Layout:
    lengths: np.ndarray  # [L, H] tokens held per (layer, head)
    next_position: int
    positions: list[torch.Tensor | None]  # per layer [sum lengths] int64, None when each head holds 0..len-1
    masses: list[torch.Tensor | None]  # per layer [sum lengths] fp32, None when all zero

    def layer_positions(self, layer: int, device=None) -> torch.Tensor:
        """Positions of layer's tokens in (head, token) order, contiguous or not."""
        if self.positions[layer] is not None:
            return upload(self.positions[layer], torch.device(device)) if device is not None else self.positions[layer]
        return token_runs(self.lengths[layer], device)[1]

    def meta(self) -> dict:
        # recomputable: a prefill of the token history rebuilds exactly this layout (nothing evicted,
        # no H2O masses to keep), so a restore may recompute it instead of reading what was stored.
        recomputable = self.is_contiguous() and all(m is None for m in self.masses)
        return {"lengths": self.lengths.tolist(), "next_position": self.next_position, "recomputable": recomputable}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for layer, (pos, mass) in enumerate(zip(self.positions, self.masses)):
            if pos is not None:
                out[f"pos.{layer}"] = pos
            if mass is not None:
                out[f"mass.{layer}"] = mass
        return out

    @classmethod
    def from_stored(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> Layout:
        lengths = np.asarray(meta["lengths"], dtype=np.int64)
        L = lengths.shape[0]
        return cls(lengths, int(meta["next_position"]),
                   [tensors.get(f"pos.{layer}") for layer in range(L)],
                   [tensors.get(f"mass.{layer}") for layer in range(L)])

    def is_contiguous(self) -> bool:
        """Every head of every layer holds exactly positions 0..next_position-1 (nothing evicted)."""
        return all(p is None for p in self.positions) and bool((self.lengths == self.next_position).all())


def layout_of(seq: SequenceKV, flat: tuple[list, list] | None = None) -> Layout:
    """The sequence's layout; flat: all_slots(seq), when the caller has it. Reads back one [L, 2]
    flag array (which layers' positions have gaps, which carry masses), not one value per layer."""
    pool = seq.pool
    slots, index = all_slots(seq) if flat is None else flat
    positions, masses, flags = [], [], []
    for layer, s in enumerate(slots):
        pos = pool.positions[layer].view(-1).index_select(0, s)
        mass = pool.attention_mass[layer].view(-1).index_select(0, s)
        positions.append(pos)
        masses.append(mass)
        flags.append(torch.stack([(pos != index[layer]).any(), (mass != 0).any()]))
    gaps, massed = (torch.stack(flags).cpu().T.tolist() if flags else ([], []))
    return Layout(seq.lengths.copy(), seq.next_position,
                  [p.clone() if gap else None for p, gap in zip(positions, gaps)],
                  [m.clone() if has else None for m, has in zip(masses, massed)])


def all_slots(seq: SequenceKV) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the flat pool slots of its tokens in (head, token) order and each one's index within
    its head, made in one pass (kv/token_slots.py)."""
    return layer_slots(seq.device_table(), seq.lengths, seq.pool.page_size)


def _slots_from(seq: SequenceKV, layer: int, start: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    slots = slots_of(seq, layer) if slots is None else slots
    if start <= 0:
        return slots
    return slots[seq.pool.positions[layer].view(-1).index_select(0, slots) >= start]


def export_rows(seq: SequenceKV, layer: int, start: int = 0,
                slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V rows [n, D] of the layer's tokens at positions >= start, in (head, token) order, in the
    compute dtype (dequantized from a quantized pool). slots: the layer's, when the caller has them."""
    slots = _slots_from(seq, layer, start, slots)
    return seq.pool.rows(layer, slots, "k"), seq.pool.rows(layer, slots, "v")


def stored_rows(seq: SequenceKV, layer: int, start: int = 0,
                slots: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The same rows as they are stored: {"k", "v"}, plus {"k_scale", "v_scale"} for a quantized pool
    (int8 / fp8 codes and their scales). PagePool.write(layer, slots, **rows) restores them exactly."""
    return seq.pool.export_rows(layer, _slots_from(seq, layer, start, slots))


STORED_KINDS = ("k", "v", "k_scale", "v_scale")


def put_stored_rows(tensors: dict[str, torch.Tensor], layer: int, rows: dict[str, torch.Tensor]) -> None:
    """Name a layer's stored rows in an export: k.{l}, v.{l}, and k_scale.{l}, v_scale.{l} when quantized."""
    for kind, t in rows.items():
        tensors[f"{kind}.{layer}"] = t


def get_stored_rows(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The stored rows of a layer in an export, as PagePool.write's keyword arguments."""
    return {kind: tensors[f"{kind}.{layer}"] for kind in STORED_KINDS if f"{kind}.{layer}" in tensors}


def reserve_for(seq: SequenceKV, layout: Layout) -> list[torch.Tensor]:
    """Take pages for the layout in an empty sequence and write positions and masses; returns the
    per-layer slots in (head, token) order. All-or-nothing (KVCacheFullError leaves it empty)."""
    slots = seq.reserve_layout(layout.lengths, layout.next_position)
    pool = seq.pool
    for layer, s in enumerate(slots):
        pool.positions[layer].view(-1).index_copy_(0, s, layout.layer_positions(layer, pool.device))
        mass = layout.masses[layer]
        if mass is not None:
            pool.attention_mass[layer].view(-1).index_copy_(0, s, upload(mass, pool.device).to(torch.float32))
        else:
            pool.attention_mass[layer].view(-1).index_fill_(0, s, 0.0)
    return slots


def slots_of(seq: SequenceKV, layer: int) -> torch.Tensor:
    """Flat pool slots of the layer's tokens in (head, token) order."""
    return layer_slots(seq.device_table(), seq.lengths, seq.pool.page_size, [layer])[0][0]


def export_kv(seq: SequenceKV) -> tuple[dict, dict[str, torch.Tensor]]:
    """The whole KV as (meta, tensors): k.{l}, v.{l} (with k_scale.{l}, v_scale.{l} from a quantized
    pool: its codes and scales, not dequantized rows) plus the layout's tensors."""
    flat = all_slots(seq)
    layout, slots = layout_of(seq, flat), flat[0]
    tensors = layout.tensors()
    for layer in range(seq.pool.num_layers):
        put_stored_rows(tensors, layer, stored_rows(seq, layer, slots=slots[layer]))
    return layout.meta(), tensors


def import_kv(seq: SequenceKV, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Put an exported KV back into an empty sequence, exactly as it was."""
    layout = Layout.from_stored(meta, tensors)
    slots = reserve_for(seq, layout)
    pool = seq.pool
    for layer, s in enumerate(slots):
        pool.write(layer, s, **{kind: t.to(pool.device) for kind, t in get_stored_rows(tensors, layer).items()})
