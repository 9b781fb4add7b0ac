"""The serving store's TierHook under tensor parallelism, over rank 0's StateTierHook (EngineOps makes
it): every change runs on every rank's own hook through EngineOps.run, in the worker thread's order,
each rank storing its shard of a conversation under the conversation's id; reads are rank 0's.

What depends on time is decided on rank 0 and sent to the workers as data, so that every rank makes
the same moves:
- which packs running on the background packers are taken (settle): those finished on rank 0; a
  worker whose own pack of them has not finished waits for it;
- whether a conversation being packed can begin a turn (begin): PackInFlight while rank 0's pack runs
  (every rank moves that pack to the front of its packer's queue); once it has finished there, every
  rank takes it, a worker waiting for its own.
The disk tier is durable: a stopped server leaves its idle conversations there, each rank its shard
in its own folder (turnkv/parallel/disk_layout.py), and a server started over the same folder at the
same size takes back those that every rank holds alike (`kept`), each rank rebuilding the
conversation from its own stored record.
"""

from __future__ import annotations

import logging

from turnkv.engine.conversation import Conversation
from turnkv.errors import ParallelError
from turnkv.parallel.mirror import gather
from turnkv.serve.tier_hook import warn_stored_elsewhere
from turnkv.state.background import PackInFlight

log = logging.getLogger("turnkv.serve")


# ---- operations (run by EngineOps.run on every rank: op(ctx, *args), ctx an engine_ops.Ctx) --------------
def tier(ctx, method: str, cid: str | None, *args):
    """ctx.tiers.<method>(conversation, *args) (cid None: without a conversation, as land)."""
    call = getattr(ctx.tiers, method)
    return call(*args) if cid is None else call(ctx.convs[cid], *args)


def take_back(ctx, cid: str) -> Conversation:
    """The conversation the rank's disk tier holds under `cid`, rebuilt from the rank's own record (its
    KV comes back at its next turn)."""
    conv = Conversation.from_record(ctx.llm, cid, ctx.llm.state.record(cid))
    ctx.convs[cid] = conv
    return conv


def disk_entries(llm) -> dict[str, tuple[int, int]]:
    """{id: (tokens of its history, their hash)} of each conversation the rank's disk tier holds (read
    through mirror.gather; an entry whose record cannot be read is left out)."""
    tiers, out = llm.state.tiers, {}
    for key in tiers.keys("disk"):
        try:
            tokens = tiers.meta(key)["conversation"]["tokens"]
            out[key] = (len(tokens), hash(tuple(tokens)))  # an int tuple's hash is the same in every process
        except Exception as e:  # noqa: BLE001 - left on disk as it is
            log.warning("stored conversation %s cannot be read: %s", key, e)
    return out


class LockstepTiers:
    def __init__(self, ops, hook):
        """ops: the EngineOps; hook: rank 0's StateTierHook (each worker has its own)."""
        self.ops, self.hook, self.names = ops, hook, hook.names
        self.manager = hook.manager

    @property
    def durable(self) -> bool:
        return self.hook.durable

    def begin(self, conv) -> list[str]:
        leaving = self.manager.leaving.get(conv.id)
        if leaving is not None and not leaving.job.future.done():
            self.ops.run(tier, "hurry", conv.id)
            raise PackInFlight(f"conversation {conv.id} is being packed")
        return self.ops.run(tier, "begin", conv.id, True)

    def end(self, conv) -> None:
        self.ops.run(tier, "end", conv.id)

    def offload(self, conv, durable: bool = False) -> bool:
        return self.ops.run(tier, "offload", conv.id, durable)

    def discard(self, conv) -> None:
        self.ops.run(tier, "discard", conv.id)

    def settle(self, block: bool = False) -> int:
        """As StateTierHook.settle, over the packs finished on rank 0 (no operation when none has)."""
        if block:
            self.manager.wait_for_a_pack()
        done = self.manager.packs_done()
        if not done:
            return 0
        # The tiers they landed in are compared across ranks: one that kept a conversation on the GPU
        # where another stored it breaks the engine.
        return len(self.ops.run(tier, "land", None, done))

    def packing(self) -> int:
        """Packs in flight on rank 0 (the packs settle takes are those finished there)."""
        return self.hook.packing()

    def watch_packs(self, fn):
        return self.hook.watch_packs(fn)  # rank 0's packs

    def where(self, conv) -> str:
        return self.hook.where(conv)

    def stored_bytes(self, conv) -> int:
        return self.hook.stored_bytes(conv)

    def reserve(self) -> None:
        self.hook.reserve()

    def kept(self) -> list[tuple[Conversation, float]]:
        """Conversations an earlier server at this size left in the disk tier that every rank holds
        alike (the same token history), each taken back on every rank; with the time.time() of their
        last use. Only at start-up, before the worker thread runs (it reads every rank through
        mirror.gather)."""
        warn_stored_elsewhere(self.manager)
        if self.manager.tiers.disk is None:
            return []
        first, *others = gather(self.ops.llm, disk_entries)
        agreed = [cid for cid, n in first.items() if all(held.get(cid) == n for held in others)]
        for cid in sorted(set(first).union(*others) - set(agreed)):
            log.warning("stored conversation %s is not held alike by every rank's disk folder: left there, not "
                        "taken back", cid)
        out = []
        for cid in agreed:
            try:
                conv = self.ops.run(take_back, cid)
            except ParallelError:
                raise
            except Exception as e:  # the same on every rank: left on disk as it is
                log.warning("stored conversation %s cannot be resumed: %s", cid, e)
                continue
            out.append((conv, float(self.manager.tiers.meta(cid).get("last_used", 0.0))))
        return out
