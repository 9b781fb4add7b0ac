"""Recipes a tensor-parallel engine cannot run exactly, refused when a conversation asks for them."""

from __future__ import annotations

from turnkv.errors import InvalidRequestError
from turnkv.model.parallel import Shard


def check_recipe(recipe, shard: Shard | None) -> None:
    """InvalidRequestError for a recipe that reads a KV head's whole query group where the ranks split
    it (more ranks than KV heads: each replica of a KV head holds part of its group's query heads).
    Such a decision would differ between replicas and from one device's. Nothing on one device."""
    if shard is None or shard.replicas == 1:
        return
    reasons = []
    if recipe.evict is not None:
        reasons.append(f"evict={recipe.evict.scorer.name} scores each KV head from its query group")
    decode = recipe.decode
    if getattr(decode, "group", "query") != "query" or getattr(decode, "granularity", "query") != "query":
        reasons.append(f"decode={decode.name} selects per KV head from its query group")
    if reasons:
        raise InvalidRequestError(
            f"tensor_parallel={shard.size} splits each of the model's {shard.config.num_kv_heads} KV heads' query "
            f"groups over {shard.replicas} ranks, and {'; '.join(reasons)}: use tensor_parallel <= "
            f"{shard.config.num_kv_heads}, or a recipe without it")
