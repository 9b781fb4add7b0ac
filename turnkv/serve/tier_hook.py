"""The serving store's TierHook (turnkv/serve/store.py) over the engine's state manager (`llm.state`).

Idle conversations the store evicts from the KV pool go to the CPU tier (and from there to the disk,
least recently used first), in the form their recipe's state strategy stores; they come back when a
request continues them. At shutdown they go to the disk tier, where a server started over the same
directory finds them again (`kept`); under tensor parallelism only a server of the same size does
(turnkv/parallel/disk_layout.py), and one of another size logs what it leaves there.
"""

from __future__ import annotations

import logging
import time

from turnkv.engine.conversation import Conversation
from turnkv.kv.tiers import StateTiersFullError
from turnkv.parallel.disk_layout import stored_elsewhere

log = logging.getLogger("turnkv.serve")


class StateTierHook:
    """on_traffic(direction, nbytes, seconds), when given, is called for each conversation moved:
    "restore" (a tier -> the pool, in begin) and "offload" (the pool -> a tier: offload, and end for a
    strategy that stores the state after every turn). nbytes is what the
    tier holds for it; seconds is the worker's time in the move, which for a restore is the time to
    issue its copies (a strategy may leave them running on a side stream until the turn ends) and
    includes the offloads of idle conversations the manager demoted to make room for it (reported
    with their bytes and 0 s)."""

    names = ("cpu", "disk")

    def __init__(self, manager, tier: str = "cpu", on_traffic=None):
        self.manager, self.tier = manager, tier
        self.on_traffic = on_traffic

    def reserve(self) -> None:
        """Allocate (and pin) the CPU tier now: at the first offload every running stream would wait
        for it (pinning tens of GiB takes seconds)."""
        start = time.perf_counter()
        host = self.manager.tiers.host
        if host is not None:
            log.info("CPU tier: %.1f GiB of %s host memory in %.1f s", host.capacity / 2**30,
                     "pinned" if host.pinned else "pageable", time.perf_counter() - start)

    @property
    def durable(self) -> bool:
        return self.manager.tiers.disk is not None

    def begin(self, conv, wait_for_pack: bool = False) -> list[str]:
        # A conversation still being packed in the background raises PackInFlight (its pack moves to
        # the front): the worker retries once settle() has taken the pack, instead of waiting here.
        # wait_for_pack: wait for it instead (a tensor-parallel worker, whose rank 0 saw it done).
        if not wait_for_pack:
            self.manager.check_not_leaving(conv)
        if conv.id in self.manager.leaving:  # done, not taken yet: take it first (counted as settle does)
            self.land([conv.id])
        # before_turn restores the state if it left the GPU, making room by demoting idle resident
        # conversations, and puts this one in the manager's busy set: while a request runs on it,
        # making room for another conversation never demotes it (its next decode step reads the pages).
        start = len(self.manager.events)
        stored = self.manager.where(conv) not in (None, "gpu")
        nbytes = self.manager.stored_bytes(conv) if stored else 0
        began = time.perf_counter()
        try:
            self.manager.before_turn(conv, 0, wait_for_packs=False)  # short of room: KVCacheFullError
        except BaseException:
            self.manager.abort_turn(conv)  # nothing was restored: it stays stored, and idle
            raise
        finally:
            moved = self._take_events(start)
        if stored and self.on_traffic is not None:
            self.on_traffic("restore", nbytes, time.perf_counter() - began)
        return moved

    def end(self, conv) -> None:
        # Also for an undone request: its KV is back to what it was, and the restore's source copy
        # (or a strategy that offloads between turns) is dealt with as after any turn.
        start = len(self.manager.events)
        began = time.perf_counter()
        self.manager.after_turn(conv)
        # A strategy that offloads between turns (state=krul, ...) moved the conversation off the GPU here
        # (with a packer, it is leaving: settle() counts it when its pack lands).
        if (self.on_traffic is not None and self.manager.where(conv) not in (None, "gpu")
                and conv.id not in self.manager.leaving):
            self.on_traffic("offload", self.manager.stored_bytes(conv), time.perf_counter() - began)
        self._take_events(start)

    def offload(self, conv, durable: bool = False) -> bool:
        if durable and not self.durable:
            return False
        began = time.perf_counter()
        try:
            landed = self.manager.offload(conv, "disk" if durable else self.tier)
        except StateTiersFullError:
            return False  # every tier is full: the store decides what to drop
        if landed != "gpu" and self.on_traffic is not None:
            self.on_traffic("offload", self.manager.stored_bytes(conv), time.perf_counter() - began)
        # "gpu": the manager never saw the conversation run, so it stored nothing; saying True would
        # lose its KV when the store frees the pages.
        return landed != "gpu"

    def settle(self, block: bool = False) -> int:
        """Take the packs that finished in the background (with block, wait for one first when none
        has): their pages go back to the pool. Returns how many conversations it took."""
        start = len(self.manager.events)
        return len(self._landed(start, self.manager.land_packs(block)))

    def packing(self) -> int:
        """Packs in flight: conversations leaving the pool whose pages come back when they land."""
        return len(self.manager.leaving)

    def watch_packs(self, fn):
        """Call fn() (on the packer's thread) whenever a pack finishes; returns what stops that."""
        return self.manager.watch_packs(fn)

    def land(self, conversation_ids: list[str]) -> tuple[str, ...]:
        """Take the packs of these conversations (waiting for those not finished): as settle, for a
        tensor-parallel worker told by rank 0 which to take. The tier each one landed in."""
        start = len(self.manager.events)
        return tuple(x["tier"] for x in self._landed(start, self.manager.land(conversation_ids)))

    def hurry(self, conv) -> None:
        """Run the conversation's pack next, if it is being packed and its pack has not started."""
        self.manager.hurry(conv)

    def _landed(self, start: int, landed: list[dict]) -> list[dict]:
        """Count the packs the manager just took (its land_packs or land, which added the events
        from `start`) in the metrics."""
        self._take_events(start)
        if self.on_traffic is not None:
            for x in landed:
                if x["tier"] != "gpu":  # the worker's time: the pack ran on the packer's thread
                    self.on_traffic("offload", x["bytes"], 0.0)
        return landed

    def discard(self, conv) -> None:
        self.manager.discard(conv)

    def where(self, conv) -> str:
        return self.manager.where(conv) or "gpu"

    def stored_bytes(self, conv) -> int:
        return self.manager.stored_bytes(conv)

    def kept(self) -> list[tuple[object, float]]:
        """Conversations an earlier process left on disk, with the time.time() of their last use."""
        warn_stored_elsewhere(self.manager)
        out = []
        for key in self.manager.tiers.keys("disk"):
            try:
                used = float(self.manager.tiers.meta(key).get("last_used", 0.0))
                out.append((Conversation.from_record(self.manager.llm, key, self.manager.record(key)), used))
            except Exception as e:  # left on disk as it is: nothing is deleted that could not be read
                log.warning("stored conversation %s cannot be resumed: %s", key, e)
        return out

    def _take_events(self, start: int) -> list[str]:
        """The manager's events since `start`, taken off its list (a server runs for long; the store
        counts them in /metrics instead): "offloaded" for each conversation it demoted."""
        events = self.manager.events[start:]
        del self.manager.events[start:]
        for e in events:
            if e["event"] == "corrupt_state_recomputed":
                log.warning("conversation %s: stored state unreadable, its history is recomputed: %s",
                            e["conversation"], e["error"])
            elif e["event"] == "disk_state_recomputed":
                log.info("conversation %s: recomputed (%.2f s estimated) instead of read from disk (%.2f s)",
                         e["conversation"], e["recompute_s"], e["read_s"])
        demoted = [e for e in events if e["event"] == "demoted"]
        if self.on_traffic is not None:
            for e in demoted:  # moved by the manager to make room: its time is the caller's (begin's)
                try:
                    self.on_traffic("offload", self.manager.tiers.stored_bytes(e["conversation"]), 0.0)
                except (KeyError, OSError):
                    pass
        return ["offloaded" for _ in demoted]


def warn_stored_elsewhere(manager) -> None:
    """Log the conversations that engines of another tensor-parallel size left under the disk tier's
    state_disk_dir: a server at this size does not take them back."""
    if manager.tiers.disk is None:
        return
    root, size = manager.disk_root()
    for m, ids in stored_elsewhere(root, size).items():
        log.warning("%d stored conversations in %s were left by a server at tensor_parallel=%d; this one runs at "
                    "tensor_parallel=%d and does not take them back (a server at tensor_parallel=%d over the same "
                    "folder continues them)", len(ids), root, m, size, m)
