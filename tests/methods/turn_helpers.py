"""Conversations, messages and KV snapshots shared by the turn-policy tests."""

from __future__ import annotations

import numpy as np
import torch

from turnkv.kv.sequence import SequenceKV

SYSTEM = ("You are a helpful assistant who answers questions about geography, rivers, mountains and oceans "
          "with short precise sentences, careful facts, friendly tone, and a clear structure for students "
          "of every age.")
MESSAGES = [
    "Tell me about the longest rivers on each continent and why they matter to people living nearby.",
    "Now describe the tallest mountains, who first climbed them, and what the weather is like at the top.",
    "Which oceans are deepest, and what strange animals live down in the dark trenches far below?",
    "Summarise everything so far in three short bullet points for a school report.",
]
CONTEXT = ("The Amazon river flows through Brazil, Peru and Colombia. The Nile crosses eleven countries in Africa. "
           "The Yangtze is the longest river in Asia, and the Mississippi drains much of North America. "
           "Mount Everest rises on the border of Nepal and China, while Aconcagua is the highest peak in the Andes.")
NEW = 8  # tokens per reply; ignore_eos keeps every reply exactly this long


def dims(conv):
    return conv.llm.config.num_layers, conv.llm.config.num_kv_heads


def held(conv, lo, hi) -> np.ndarray:
    """[layers, heads] tokens held with positions in [lo, hi)."""
    L, _ = dims(conv)
    return np.stack([conv.kv.count_positions(layer, lo, hi) for layer in range(L)])


def snapshot(kv: SequenceKV):
    """Per layer and head: (K, V, positions) of the held tokens, copied."""
    out = []
    for layer in range(kv.lengths.shape[0]):
        k, v, pos = kv.gather(layer)
        out.append([(k[h, :n].clone(), v[h, :n].clone(), pos[h, :n].clone()) for h, n in enumerate(kv.lengths[layer])])
    return out


def below(snap, upto):
    """The entries of a snapshot whose position is < upto."""
    return [[tuple(t[h[2] < upto] for t in h) for h in layer] for layer in snap]


def same(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y)
               for la, lb in zip(a, b) for ha, hb in zip(la, lb) for x, y in zip(ha, hb))


def kept_positions(snap, upto):
    return [[set(h[2][h[2] < upto].tolist()) for h in layer] for layer in snap]


def send(conv, message, **kw):
    return conv.send(message, max_new_tokens=NEW, ignore_eos=True, **kw)
