"""The KV bytes one decode step must read under a recipe: what `turnkv bench speed` and the decode
scripts set beside a measured time per token (floor = (weights + these bytes) / copy bandwidth)."""

from __future__ import annotations


def decode_kv_read_bytes(recipe, config, element_size: float, context: int, kept_bytes: int) -> float:
    """KV bytes one step of one conversation reads, amortised over a selection's reuse.

    element_size: bytes per stored K or V element (a quantized pool's scales spread over them);
    kept_bytes: what the conversation holds (the step reads all of it without a decode selection).
    With a selection, per layer: LoopServe's rows (query heads, or KV heads with granularity=kv) read
    the budget plus the tokens since the re-selection (half an interval on average), and every key
    once per re-selection; Quest / LServe rows read the selected pages (streaming heads their sink +
    local window, dense layers everything), plus the page statistics once per selection."""
    if not recipe.selects_decode:
        return kept_bytes
    L, H, Hq, D = config.num_layers, config.num_kv_heads, config.num_heads, config.head_dim
    per_token_head = 2 * D * element_size  # K and V
    d = recipe.decode
    if d.name == "loopserve":
        rows = Hq if d.granularity == "query" else H
        selected = L * rows * min(context, d.budget + d.interval / 2) * per_token_head
        rescoring = context * H * L * D * element_size / d.interval  # the keys, once per re-selection
        return selected + rescoring
    cfg = d.selector_config()
    rows = Hq if cfg.group == "query" else H
    static = recipe.static_sparsity
    streaming = float(static.flags(L, H).mean()) if static is not None else 0.0
    kept_by_streaming = static.sink + static.local if static is not None else 0
    budget = min(context, cfg.pages_budget * cfg.physical_page)
    selecting_layers = L - cfg.dense_layers
    selected = selecting_layers * rows * ((1 - streaming) * budget + streaming * kept_by_streaming) * per_token_head
    selected += cfg.dense_layers * H * context * per_token_head
    statistics = (selecting_layers * H * (1 - streaming) * (context / cfg.logical_page) * 2 * D * element_size
                  / cfg.reuse_interval)
    return selected + statistics
