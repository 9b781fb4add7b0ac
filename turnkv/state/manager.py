"""Moves conversations between the GPU (the page pool) and the CPU and disk tiers.

The engine calls it at three points of a conversation: before a turn (bring the state back, and make
room on the GPU by demoting the least recently used resident conversations), after a turn (release
what the restore read; with a strategy that offloads between turns, store the state now), and on
reset/close (forget what is stored). `conv.offload(tier)` moves a conversation down on demand.

A stored entry's meta carries the conversation's record (token history, messages, turns, recipe), so
the disk tier alone can bring a conversation back after a restart (`resume`), and a corrupt tensors
file falls back to recomputing that history. The strategy that stored an entry restores it, whatever
the conversation's recipe says now, with one exception: a disk entry whose history a prefill rebuilds
exactly (nothing evicted) is recomputed instead of read when the disk's measured read rate makes the
read alone slower than the recompute (a slow disk against a fast GPU: benchmarks/state/README.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields

import numpy as np
import torch

from turnkv.errors import InvalidRequestError
from turnkv.kv.disk import CorruptStateError
from turnkv.kv.tiers import StateTiersFullError, TieredStore
from turnkv.methods.protocols import StateStrategy
from turnkv.methods.registry import build
from turnkv.state.context import RestoreContext
from turnkv.state.recompute import RecomputeStrategy as Recompute
from turnkv.state.recompute import full_layout_meta


class StateManager:
    def __init__(self, llm, cpu_memory: int = 0, disk_dir=None, disk_memory: int | None = None,
                 gpu_memory: int | None = None, pin: bool | None = None, costs=None):
        self.llm = llm
        self.ctx = RestoreContext(llm.model, llm.pool, llm.runner, costs)
        self.tiers = TieredStore(cpu_memory, disk_dir, disk_memory, pin)
        self.gpu_memory = gpu_memory
        self.resident: OrderedDict[str, object] = OrderedDict()  # conversations on the GPU, LRU first
        self._pending: dict[str, object] = {}  # load streams of restores whose copies may be in flight
        self.events: list[dict] = []  # what happened that the caller did not ask for (fallbacks, demotions)
        # Conversations whose turn is under way (a stream not yet exhausted): never demoted, since
        # their next decode step reads the pages.
        self.busy: set[str] = set()

    # ---- queries ----------------------------------------------------------------------------
    def where(self, conv) -> str | None:
        """"gpu", "cpu", "disk", or None for a conversation that holds nothing yet."""
        if conv.id in self.resident:
            return "gpu"
        return self.tiers.tier_of(conv.id)

    def stored_bytes(self, conv) -> int:
        return self.tiers.stored_bytes(conv.id)

    # ---- engine hooks -----------------------------------------------------------------------
    def before_turn(self, conv, new_tokens: int) -> None:
        self._settle(conv)
        self.busy.add(conv.id)
        tier = self.tiers.tier_of(conv.id)
        if tier is None or conv.id in self.resident:
            if tier is not None:  # a stale copy of a state that is back on the GPU
                self.tiers.delete(conv.id)
            self._make_room(conv, conv.kv.lengths, new_tokens)
            self.resident[conv.id] = conv
            self.resident.move_to_end(conv.id)
            return
        meta = self.tiers.meta(conv.id)
        n = meta["state"]["next_position"]
        c = self.llm.config
        estimate = self._disk_estimate(meta) if tier == "disk" else None
        # A restore that prefills needs the whole history at once; one that loads, what was stored.
        stored = meta["state"].get("lengths")
        recomputes = estimate is not None and estimate["recompute_s"] < estimate["read_s"]
        if stored is None or meta["strategy"]["name"] == "recompute" or recomputes:
            stored = [[n] * c.num_kv_heads for _ in range(c.num_layers)]
        self._make_room(conv, np.asarray(stored, dtype=np.int64), new_tokens)
        if recomputes:
            strategy, tensors, state = Recompute(), {}, full_layout_meta(c.num_layers, c.num_kv_heads, n)
            self.events.append({"conversation": conv.id, "event": "disk_state_recomputed", **estimate})
        else:
            try:
                _, meta, tensors = self.tiers.get(conv.id)
                strategy = _strategy(meta["strategy"])
                state = meta["state"]
            except CorruptStateError as e:
                # The tensors are gone; the history beside them is not. Recompute it (uncompressed).
                strategy, tensors, state = Recompute(), {}, full_layout_meta(c.num_layers, c.num_kv_heads, n)
                self.events.append({"conversation": conv.id, "event": "corrupt_state_recomputed", "error": str(e)})
        window = conv.method_state.window
        if window is not None and "window.stored" in state:  # the observation window left with the KV
            window.load_tensors(tensors, self.llm.device)
        self._pending[conv.id] = strategy.restore(self.ctx, conv.kv, conv.tokens, state, tensors)
        self.resident[conv.id] = conv
        # The stored entry stays until the restore's copies are done (after_turn): its host memory
        # is being read.

    def abort_turn(self, conv) -> None:
        """The turn failed or its stream was abandoned: the conversation is idle again."""
        self.busy.discard(conv.id)

    def after_turn(self, conv) -> None:
        self.busy.discard(conv.id)
        self._settle(conv)
        if self.tiers.tier_of(conv.id) is not None:
            self.tiers.delete(conv.id)
        if conv.recipe.state.offloads_between_turns:
            try:
                self.offload(conv, "cpu")
            except StateTiersFullError as e:  # it stays on the GPU: nothing is lost
                self.events.append({"conversation": conv.id, "event": "kept_on_gpu", "error": str(e)})

    def offload(self, conv, tier: str = "cpu") -> str:
        """Store the conversation's state in `tier` (or lower) and free its GPU pages; returns the
        tier it landed in. On StateTiersFullError (no tier has room, or no GPU memory to stage the
        copy) the conversation stays as it was."""
        self._settle(conv)
        where = self.where(conv)
        if where is None:
            return "gpu"  # nothing to store yet
        if where != "gpu":
            if where == "cpu" and tier == "disk":
                self.tiers.demote(conv.id)
            return self.tiers.tier_of(conv.id)
        strategy = conv.recipe.state
        window = conv.method_state.window
        stored = self._pack(conv, strategy, window, tier)
        if "fallback" in stored.meta:  # the strategy stored it by a baseline it predicts to be faster
            self.events.append({"conversation": conv.id, "event": "state_fallback", "strategy": strategy.name,
                                "to": stored.meta["fallback"], "predicted_s": stored.meta.get("predicted_s")})
        tensors, state = stored.tensors, stored.meta
        if window is not None:  # it decides what later compressions keep: it goes where the KV goes
            tensors, state = {**tensors, **window.to_tensors()}, {**state, "window.stored": True}
        meta = {"strategy": {"name": strategy.name, "params": _params(strategy)}, "state": state,
                "conversation": conv.to_record()}
        landed = self.tiers.put(conv.id, meta, tensors, tier)
        conv.kv.free()
        del self.resident[conv.id]
        return landed

    def _pack(self, conv, strategy, window, tier: str):
        """strategy.pack, which stages the state's rows on the GPU before they go down; where that
        finds no GPU memory (an offload to make room), again one layer at a time through host memory.
        StateTiersFullError when even that fails; the pages are untouched either way."""
        for on_host in (False, True):
            self.ctx.stage_on_host = on_host
            try:
                return strategy.pack(self.ctx, conv.kv, window, tier)
            except torch.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                error = str(e).splitlines()[0]
            finally:
                self.ctx.stage_on_host = False
        raise StateTiersFullError(f"no GPU memory to stage conversation {conv.id}'s state for the copy down ({error})")

    def discard(self, conv) -> None:
        """Forget a conversation's stored state (reset, close)."""
        self._settle(conv)
        self.resident.pop(conv.id, None)
        self.tiers.delete(conv.id)

    def record(self, conversation_id: str) -> dict:
        """The history stored beside a conversation's state (Conversation.to_record), e.g. on disk
        before a restart; InvalidRequestError when none is stored under this id."""
        if self.tiers.tier_of(conversation_id) is None:
            raise InvalidRequestError(f"no stored conversation has the id {conversation_id!r}")
        return self.tiers.meta(conversation_id)["conversation"]

    # ---- internals --------------------------------------------------------------------------
    def _disk_estimate(self, meta: dict) -> dict | None:
        """Seconds to read a disk entry (at the store's measured rate; its copy to the device and any
        recompute its strategy adds come on top, so this is a lower bound) against seconds to
        recompute its history; None where recompute would not rebuild the same state, or before the
        disk's rate is known (the first read measures it)."""
        disk = self.tiers.disk
        if not meta["state"].get("recomputable") or disk is None or not disk.read_rate:
            return None
        n = meta["state"]["next_position"]
        cost = self.ctx.cost("disk")
        recompute_s = float(cost.compute_s(np.full(self.llm.config.num_layers, n)))
        return {"read_s": float(meta["nbytes"]) / disk.read_rate, "recompute_s": recompute_s}

    def _settle(self, conv) -> None:
        """Wait for a restore's copies, so its sources can be freed or reused."""
        stream = self._pending.pop(conv.id, None)
        if stream is not None:
            stream.synchronize()

    def _make_room(self, conv, lengths: np.ndarray, new_tokens: int) -> None:
        """Demote least recently used resident conversations until `conv`, holding `lengths` tokens
        per [layer, KV head] (its own, or its stored state's), can add `new_tokens` to every head.
        A compressed conversation needs pages for what it keeps, not for its positions."""
        pool = self.llm.pool
        pages = -(-(np.asarray(lengths) + new_tokens) // pool.page_size) + 1  # [L, H]: one page of slack a head
        need = np.maximum(pages - conv.kv.num_pages, 0).sum(axis=1)  # [L] pages to add per layer
        need_bytes = int(need.sum()) * pool.page_bytes

        def short() -> bool:
            if pool.reclaim is not None:  # pages only a cache holds (the prefix index) go first
                pool.reclaim(need.tolist())
            if any(pool.free_pages(layer) < need[layer] for layer in range(pool.num_layers)):
                return True
            if self.gpu_memory is None:
                return False
            held = sum(c.kv.bytes() for c in self.resident.values())
            return held + need_bytes > self.gpu_memory

        for victim_id in list(self.resident):
            if not short():
                return
            if victim_id != conv.id and victim_id not in self.busy:
                try:
                    landed = self.offload(self.resident[victim_id], "cpu")
                except StateTiersFullError as e:
                    raise StateTiersFullError(
                        f"KV pool full: this turn needs {int(need.max())} pages per layer and the idle conversation "
                        f"{victim_id} cannot move down: {e}") from None
                self.events.append({"conversation": victim_id, "event": "demoted", "tier": landed})


def _params(strategy) -> dict:
    return {f.name: getattr(strategy, f.name) for f in fields(strategy) if f.init}


def _strategy(spec: dict) -> StateStrategy:
    return build("state", spec["name"], spec["params"])
