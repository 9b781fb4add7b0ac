"""Recompute the KV of a history prefix whose length may shrink with depth (Krul's pyramid).

Layer l recomputes the tokens at positions [0, R[l]) with R non-increasing, so the hidden states it
needs are the first R[l] rows of layer l-1's output, which always exist (the Krul paper's Eq. 4-5). Under
causal attention the prefix needs no key from outside itself, so this never waits for the load
stream. The forward drives the decoder's blocks one at a time with its own attention step: a plain
causal attention over the layer's prefix that writes the K/V rows the conversation holds into the
page pool (after eviction a head may hold only some of the positions it recomputes).
"""

from __future__ import annotations

import torch

from turnkv.attention import reference


class PrefixStep:
    """AttentionStep for the recompute: writes rows (positions `rows[l]` of KV heads `heads[l]`) of
    each layer's fresh K/V to `slots[l]` of the pool. heads/rows None: every head keeps every
    recomputed token, and slots[l] lists them token-major ([r, H] flattened), the order k[0, :r] has."""

    def __init__(self, pool, slots: list[torch.Tensor], heads: list[torch.Tensor] | None,
                 rows: list[torch.Tensor] | None):
        self.pool, self.slots, self.heads, self.rows = pool, slots, heads, rows

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.slots[layer].numel():
            if self.heads is None:
                D = k.shape[-1]
                self.pool.write(layer, self.slots[layer], k[0].reshape(-1, D), v[0].reshape(-1, D))
            else:
                rows, heads = self.rows[layer], self.heads[layer]
                self.pool.write(layer, self.slots[layer], k[0, rows, heads], v[0, rows, heads])
        # K/V as the store gives them back (a quantized pool's round trip), as the prefill read them.
        k, v = self.pool.round_trip(k), self.pool.round_trip(v)
        out = reference.causal_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


@torch.inference_mode()
def recompute_prefix(model, token_ids: list[int], lengths: list[int], step: PrefixStep) -> None:
    """Run the blocks over the first lengths[l] tokens at layer l (lengths non-increasing)."""
    if any(b > a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"per-layer recompute lengths must not increase with depth: {lengths}")
    n = lengths[0] if lengths else 0
    if n == 0:
        return
    device = model.embed_tokens.weight.device
    ids = torch.tensor([token_ids[:n]], dtype=torch.int64, device=device)
    x = model.embed_tokens(ids)
    cos, sin = model.rope(torch.arange(n, device=device)[None], x.dtype)
    residual = None
    for layer, block in enumerate(model.layers):
        r = lengths[layer]
        if r == 0:
            break
        x, residual = block(x[:, :r], None if residual is None else residual[:, :r], cos[:, :r], sin[:, :r], step)
