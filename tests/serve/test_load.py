"""Many conversations at once: decode steps are batched, every reply is the one its conversation gets
alone (no cross-talk), no request is lost, and the KV pool comes back to its baseline. A small pool
evicts idle conversations least recently used first and keeps serving correctly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serve.conftest import MODEL, running, wait_for

TURNS = ["Tell me a story about {}.", "Make it shorter.", "Now give it a title."]
SUBJECTS = ["a cat", "the moon", "a red kite", "old bridges", "tea", "winter", "a robot", "the sea", "a violin",
            "maps", "bees", "a lighthouse", "snow", "a clock", "rivers", "a garden", "trains", "a fox", "glass",
            "deserts", "owls", "a market", "storms", "a library", "salt", "kites", "whales", "a mountain", "bread",
            "a key", "lanterns", "a comet"]


def converse(client, index: int, max_tokens: int = 8, **headers) -> list[tuple[str, int]]:
    """One multi-turn conversation; returns (reply, cached_tokens) per turn."""
    messages = [{"role": "system", "content": f"You are storyteller number {index}."}]
    out = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn.format(SUBJECTS[index % len(SUBJECTS)])})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_headers=headers or None)
        reply = r.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        out.append((reply, r.usage.prompt_tokens_details.cached_tokens))
    return out


def test_32_concurrent_conversations_match_their_solo_runs(serve_llm):
    n = 32
    with running(serve_llm, served_model_name=MODEL, max_running=n, max_waiting=n) as s:
        # Pages of conversations, besides the system prompts the prefix index keeps.
        def held() -> int:
            return serve_llm.pool.bytes_in_use() - serve_llm.prefix_cache_bytes()

        baseline = held()
        client = s.client()
        alone = [converse(client, i) for i in range(n)]
        assert s.scheduler.flush()[0] == n
        assert held() == baseline
        successes = s.metric("vllm:request_success_total")
        steps_alone, rows_alone = s.metric("turnkv:decode_batch_size_count"), s.metric("turnkv:decode_batch_size_sum")
        with ThreadPoolExecutor(n) as pool:
            together = list(pool.map(lambda i: converse(s.client(), i), range(n)))
        assert [[reply for reply, _ in conv] for conv in together] == [[reply for reply, _ in conv] for conv in alone]
        # Every later turn reused its own conversation, exactly as when it ran alone (a first turn
        # takes the system prompt from the prefix index once some conversation has prefilled it).
        assert [[cached for _, cached in conv[1:]] for conv in together] == \
            [[cached for _, cached in conv[1:]] for conv in alone]
        assert all(cached > 0 for conv in together for _, cached in conv[1:])
        assert s.metric("vllm:request_success_total") - successes == n * len(TURNS)  # none lost
        assert s.metric("turnkv:requests_failed_total") == 0
        # Decode steps ran over many sequences at once (alone, every step had one).
        assert rows_alone == steps_alone
        steps = s.metric("turnkv:decode_batch_size_count") - steps_alone
        assert (s.metric("turnkv:decode_batch_size_sum") - rows_alone) / steps > 8
        # Conversations end: dropping them gives every page back.
        assert s.metric("turnkv:stored_conversations", tier="gpu") == n
        assert httpx.post(s.url + "/flush_cache").json()["flushed"] == n
        assert s.metric("turnkv:kv_pool_bytes_used") == serve_llm.pool.bytes_in_use() == 0
        assert s.metric("vllm:num_requests_running") == 0 == s.metric("vllm:num_requests_waiting")


def test_a_small_pool_evicts_idle_conversations_lru_and_stays_correct(chat_model_dir, serve_llm):
    import turnkv

    with running(serve_llm, served_model_name=MODEL) as roomy:
        reference = [converse(roomy.client(), i) for i in range(6)]
        roomy.scheduler.flush()
    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="96KiB")
    with running(small, served_model_name=MODEL, tiers=None) as s:
        client = s.client()
        got = [converse(client, i) for i in range(6)]
        assert [[r for r, _ in c] for c in got] == [[r for r, _ in c] for c in reference]
        evicted = s.metric("turnkv:conversation_evictions_total", reason="dropped")
        assert evicted > 0 and s.metric("turnkv:stored_conversations", tier="gpu") < 6
        assert small.pool.bytes_in_use() <= small.pool.capacity_bytes()
        # The oldest conversations went first: the newest one is still there.
        assert s.store.entries[-1].conv.messages[0]["content"] == "You are storyteller number 5."
        assert all("number 0." not in e.conv.messages[0]["content"] for e in s.store.entries)


def test_idle_conversations_expire_after_their_ttl(serve_llm):
    with running(serve_llm, served_model_name=MODEL, idle_ttl_s=0.3) as s:
        # Pages of conversations, besides what the prefix index keeps (system prompts, turn ends).
        def held() -> int:
            return serve_llm.pool.bytes_in_use() - serve_llm.prefix_cache_bytes()

        baseline = held()
        converse(s.client(), 0, max_tokens=3)
        # Its pages are all the index's last turn end holds, too: they cost nothing more while it lives.
        assert s.store.kv_bytes("gpu") > 0 and held() == baseline
        wait_for(lambda: s.store.count("gpu") == 0, timeout=5, what="the idle conversation to expire")
        assert held() == baseline
        assert s.metric("turnkv:conversation_evictions_total", reason="idle_ttl") == 1


class RecomputeTier:
    """A tier hook that keeps only the token history and rebuilds the KV by prefilling it again."""

    names, durable = ("offloaded",), False

    def __init__(self, llm):
        self.llm, self.held, self.restored = llm, {}, 0

    def begin(self, conv) -> list[str]:
        if id(conv) in self.held:
            self.llm.runner.prefill(conv.kv, conv.tokens[: self.held[id(conv)]])  # may fail for room: keep it held
            del self.held[id(conv)]
            self.restored += 1
        return []

    def end(self, conv) -> None:
        pass

    def offload(self, conv, durable: bool = False) -> bool:
        if durable:
            return False
        self.held[id(conv)] = conv.kv.next_position
        return True

    def discard(self, conv) -> None:
        self.held.pop(id(conv), None)

    def settle(self, block: bool = False) -> int:
        return 0  # nothing moves in the background

    def packing(self) -> int:
        return 0

    def watch_packs(self, fn):
        return lambda: None

    def where(self, conv) -> str:
        return "offloaded" if id(conv) in self.held else "gpu"

    def stored_bytes(self, conv) -> int:
        return 0  # token ids only, which the conversation keeps anyway

    def kept(self) -> list:
        return []


def test_a_tier_hook_takes_evicted_conversations_and_gives_them_back(chat_model_dir):
    import turnkv

    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="96KiB")
    tier = RecomputeTier(small)
    with running(small, served_model_name=MODEL, tiers=tier) as s:
        client = s.client()
        for i in range(6):
            converse(client, i, max_tokens=4)
        assert s.metric("turnkv:conversation_evictions_total", reason="offloaded") > 0
        assert s.metric("turnkv:stored_conversations", tier="offloaded") > 0
        assert s.metric("turnkv:stored_kv_bytes", tier="offloaded") == 0  # off the pool
        # Conversation 0 was offloaded; its next turn restores it and reuses everything it had.
        messages = [{"role": "system", "content": "You are storyteller number 0."}]
        entry = next(e for e in s.store.entries if e.conv.messages[:1] == messages)
        assert s.store.where(entry) == "offloaded"
        history = len(entry.conv.tokens)
        messages = entry.conv.messages + [{"role": "user", "content": "One more line."}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert tier.restored >= 1 and s.store.where(entry) == "gpu"
        assert r.usage.prompt_tokens_details.cached_tokens == history - 1  # all but the unfed last token
