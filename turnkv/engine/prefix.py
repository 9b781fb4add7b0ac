"""Shared prefixes: a conversation whose first turn begins with a system prompt that an earlier
conversation of the same model and recipe prefilled takes that prompt's KV from the engine's prefix
index (turnkv/kv/prefix_index.py) instead of computing it again.

A first turn with a system prompt always prefills it as its own slice and lets the recipe close it
there (Recipe.after_prefix: FlowKV compresses it from its own queries); the KV and the recipe's
bookkeeping at that boundary depend on the system prompt's tokens alone. `publish` keeps them in the
index; `attach` gives them to a new conversation, which then prefills only the rest. With or without
the index a turn computes the same thing, so replies are the same token for token.

Namespace: the model's name and the recipe's canonical string. Not shared: recipes that add up
attention into the kept tokens' statistics (H2O writes into every page it reads), and state
strategies that record more than the last queries (Krul's whole-turn queries).
"""

from __future__ import annotations

from turnkv.methods.window import QueryWindow


def namespace(conv) -> str | None:
    """The index namespace of `conv`'s prefixes, or None where its engine has no index or its recipe
    cannot share."""
    llm, recipe, st = conv.llm, conv.recipe, conv.method_state
    if getattr(llm, "prefix_index", None) is None or recipe.accumulates_attention:
        return None
    if st.window is not None and type(st.window) is not QueryWindow:
        return None
    return f"{llm.name} | {recipe}"


def attach(conv, prompt: list[int], prefix_end: int) -> int:
    """Give an empty conversation the indexed KV of prompt[:prefix_end] (its first turn's system
    prompt) and the recipe's bookkeeping at that point; returns the tokens attached (0: none)."""
    key = namespace(conv)
    if key is None or prefix_end <= 0 or conv.kv.next_position or conv.turns:
        return 0
    entry = conv.llm.prefix_index.lookup(key, prompt[:prefix_end], lengths={prefix_end})
    if entry is None:
        return 0
    conv.kv.share_from(entry.kv)
    st, extra = conv.method_state, entry.extra
    st.frozen_upto, st.since_compression = extra["frozen_upto"], extra["since_compression"]
    st.log.extend(dict(e) for e in extra["log"])
    st.pattern_stats.extend(dict(e) for e in extra["pattern_stats"])
    if st.window is not None and extra["window"] is not None:
        st.window.restore(extra["window"])
    return prefix_end


def publish(conv, tokens: list[int]) -> None:
    """Keep `conv`'s KV, which holds exactly `tokens` (a first turn's system prompt, prefilled and
    closed by the recipe), in the index, unless it is there already."""
    key = namespace(conv)
    if key is None or conv.kv.next_position != len(tokens):
        return
    index = conv.llm.prefix_index
    if index.get(key, tokens) is not None:
        return
    st = conv.method_state
    extra = {"frozen_upto": st.frozen_upto, "since_compression": st.since_compression,
             "log": [dict(e) for e in st.log], "pattern_stats": [dict(e) for e in st.pattern_stats],
             "window": st.window.snapshot() if st.window is not None else None}
    index.insert(key, tokens, conv.kv, extra)
