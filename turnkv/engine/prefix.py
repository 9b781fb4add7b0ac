"""Shared prefixes: a conversation whose first turn begins with tokens an earlier conversation of the
same model and recipe computed takes their KV from the engine's prefix index
(turnkv/kv/prefix_index.py) instead of computing it again. Two kinds of boundary are indexed:

- The end of a first turn's system prompt. A first turn with a system prompt always prefills it as
  its own slice and lets the recipe close it there (Recipe.after_prefix: FlowKV compresses it from
  its own queries); the KV and the recipe's bookkeeping at that boundary depend on the system
  prompt's tokens alone, under any recipe that can share at all.
- The end of every chat turn (LLM(prefix_cache="turns"), the default), under a recipe whose kept
  state depends on the token ids alone (Recipe.path_independent: nothing evicted or compressed). The
  entry holds exactly the tokens whose KV is written: the history but the reply's last token, which
  the next turn feeds. A conversation whose first request already carries earlier turns (the server
  receiving a whole message history, a branch off an earlier turn) takes the longest such entry that
  begins its prompt and prefills only the rest. The reply's KV was written by decode steps, which a
  one-pass prefill of the same tokens matches up to rounding (Recipe.path_independent says what else).

`publish` / `publish_turn_end` keep a boundary in the index; `attach` gives an entry to a new
conversation. With "system" (system prompts only) or no index, a turn computes the same thing, so
replies are the same token for token.

Namespace: the model's name and the recipe's canonical string. Not shared at all: recipes that add up
attention into the kept tokens' statistics (H2O writes into every page it reads), and state
strategies that record more than the last queries (Krul's whole-turn queries).
"""

from __future__ import annotations


def namespace(conv) -> str | None:
    """The index namespace of `conv`'s prefixes, or None where its engine has no index or its recipe
    cannot share."""
    llm, recipe = conv.llm, conv.recipe
    if getattr(llm, "prefix_index", None) is None or recipe.accumulates_attention or not recipe.state.path_independent:
        return None
    return f"{llm.name} | {recipe}"


def shares_turn_ends(conv) -> bool:
    """Whether `conv`'s turn ends go to the index and may be taken from it."""
    return conv.llm.prefix_mode == "turns" and conv.recipe.path_independent and namespace(conv) is not None


def attach(conv, prompt: list[int], prefix_end: int) -> int:
    """Give an empty conversation the longest indexed KV that begins its first turn's `prompt`, with
    the recipe's bookkeeping at that point; returns the tokens attached (0: none). prefix_end: where
    the prompt's system prompt ends (0: none). Under a recipe that shares turn ends, any entry of at
    least prefix_end tokens that leaves a token to prefill; otherwise only the system prompt's."""
    key = namespace(conv)
    if key is None or conv.kv.next_position or conv.turns:
        return 0
    index = conv.llm.prefix_index
    if shares_turn_ends(conv):
        entry = index.lookup(key, prompt[: len(prompt) - 1], at_least=max(prefix_end, 1))
    elif prefix_end > 0:
        entry = index.lookup(key, prompt[:prefix_end], lengths={prefix_end})
    else:
        return 0
    if entry is None:
        return 0
    conv.kv.share_from(entry.kv)
    st, extra = conv.method_state, entry.extra
    st.frozen_upto, st.since_compression = extra["frozen_upto"], extra["since_compression"]
    st.log.extend(dict(e) for e in extra["log"])
    st.pattern_stats.extend(dict(e) for e in extra["pattern_stats"])
    if st.window is not None and extra["window"] is not None:
        st.window.restore(extra["window"])
    return len(entry.tokens)


def publish(conv, tokens: list[int]) -> None:
    """Keep `conv`'s KV, which holds exactly `tokens` (a first turn's system prompt, prefilled and
    closed by the recipe), in the index, unless it is there already."""
    key = namespace(conv)
    if key is None or conv.kv.next_position != len(tokens):
        return
    _insert(conv, key, tokens)


def publish_turn_end(conv) -> None:
    """A chat turn of `conv` finished (its history recorded): keep its KV, which holds the history's
    first kv.next_position tokens (all but the reply's last token), in the index, when its recipe
    shares turn ends."""
    n = conv.kv.next_position
    if n == 0 or n > len(conv.tokens) or not shares_turn_ends(conv):
        return
    _insert(conv, namespace(conv), conv.tokens[:n])


def _insert(conv, key: str, tokens: list[int]) -> None:
    index = conv.llm.prefix_index
    if index.get(key, tokens) is not None:
        return
    st = conv.method_state
    extra = {"frozen_upto": st.frozen_upto, "since_compression": st.since_compression,
             "log": [dict(e) for e in st.log], "pattern_stats": [dict(e) for e in st.pattern_stats],
             "window": st.window.snapshot() if st.window is not None else None}
    index.insert(key, tokens, conv.kv, extra)
