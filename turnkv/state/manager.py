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

With a packer (`pack_in_background`, which the server turns on), the store after a turn runs on the
packer's thread (state/background.py): the conversation is "leaving" until the caller takes the
finished pack with `land_packs`, which frees its pages. Meanwhile its pages stay allocated (free
pages do not count them; `_make_room` waits for packs before it gives up), `where` names the tier it
goes to, and nothing touches it: a turn on it waits for the pack, then restores what it stored, so its
tokens are those of a pack run inline. The tiers are shared with the packer's thread under `lock`.

Under tensor parallelism (`lockstep`) every rank's manager makes the same moves at the same points,
and nothing it decides may depend on time: a pack's collectives (StateStrategy.prepare) run on the
caller's thread, which packs are taken is the caller's choice (`land`, as rank 0 saw them done), and a
disk entry is always read, never recomputed by the disk's measured rate (each rank measures its own).
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from turnkv.errors import InvalidRequestError
from turnkv.kv.disk import CorruptStateError
from turnkv.kv.tiers import StateTiersFullError, TieredStore
from turnkv.methods.protocols import StateStrategy
from turnkv.parallel.disk_layout import elsewhere_hint, root_of
from turnkv.state.background import Packer, PackInFlight
from turnkv.state.context import RestoreContext
from turnkv.state.entries import Leaving, entry_meta, strategy_of, to_host, with_window
from turnkv.state.recompute import RecomputeStrategy as Recompute
from turnkv.state.recompute import full_layout_meta

log = logging.getLogger(__name__)


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
        self.packer: Packer | None = None
        self._own_packer: Packer | None = None
        self.leaving: dict[str, Leaving] = {}  # conversations whose pack runs on the packer, oldest first
        # Resident, idle conversations whose current state a tier holds too (resident packs): leaving the
        # pool costs them only their pages. A tier may delete such a copy to make room (spare).
        self.copies: set[str] = set()
        self.resident_packs = False
        self._pack_watchers: list = []  # called on the packer's thread as each pack finishes (watch_packs)
        # Held around every use of self.tiers (and of self._pending, whose entries the tiers must
        # not demote): the packer's thread stores into them.
        self.lock = threading.RLock()
        self.lockstep = getattr(llm, "parallel", None) is not None  # tensor parallel: the same moves on every rank

    def pack_in_background(self, packer: Packer | None = None, resident: bool = False) -> None:
        """From now on, store a conversation whose strategy offloads between turns on `packer`'s
        thread (default: the engine's Packer, made on first use) instead of inside after_turn. With
        `resident` (one device only), the conversation stays in the pool after its pack lands, as a
        copy: it leaves, by freeing its pages, only when the pool needs them, and a turn that comes
        back first finds it there."""
        self.resident_packs = resident and not self.lockstep
        if packer is None:
            if self._own_packer is None:
                self._own_packer = Packer(self.llm.device)
            packer = self._own_packer
        self.packer = packer

    def calibrate_for(self, strategy: StateStrategy, tier: str = "cpu") -> None:
        """Calibrate now, on this thread (it runs the model), the restore costs a pack by `strategy`
        to `tier` reads, if it reads any: a pack on the packer's thread must not calibrate. Once per
        engine and tier (a server does it at start-up for its default recipe)."""
        if strategy.needs_costs:
            self.ctx.cost(tier)

    def pack_inline(self) -> None:
        """Take every pack in flight (waiting for them), then pack inside after_turn again."""
        while self.leaving:
            self.land_packs(block=True)
        self.packer = None

    # ---- queries ----------------------------------------------------------------------------
    def where(self, conv) -> str | None:
        """"gpu", "cpu", "disk", or None for a conversation that holds nothing yet."""
        if conv.id in self.resident:
            return "gpu"
        leaving = self.leaving.get(conv.id)
        if leaving is not None:
            return leaving.tier  # where its pack is going (its pages are still held)
        return self.tiers.tier_of(conv.id)

    def stored_bytes(self, conv) -> int:
        """Bytes the tiers hold for the conversation; KeyError while nothing is stored (or its pack
        has not landed)."""
        if conv.id in self.leaving:
            raise KeyError(f"conversation {conv.id} is being packed")
        try:  # without the lock first: /metrics reads this on the server's event loop
            return self.tiers.stored_bytes(conv.id)
        except KeyError:  # or it moved between tiers just then, under the packer's hands: ask again
            with self.lock:
                return self.tiers.stored_bytes(conv.id)

    # ---- engine hooks -----------------------------------------------------------------------
    def before_turn(self, conv, new_tokens: int, wait_for_packs: bool = True) -> None:
        """Bring the state back if it left the GPU, making room by demoting idle resident
        conversations and, with wait_for_packs, by waiting for packs in flight to land (without, it
        takes only those done, and a restore short of pages raises KVCacheFullError: the caller may
        retry later instead of waiting)."""
        self._cancel_copy(conv)
        if conv.id in self.leaving:  # its pack runs on the packer: the turn waits for it, then restores
            self._land(self.leaving.pop(conv.id))
        self.copies.discard(conv.id)  # the turn changes the state: a copy of it goes stale
        self._settle(conv)
        self.busy.add(conv.id)
        with self.lock:
            tier = self.tiers.tier_of(conv.id)
            if tier is None or conv.id in self.resident:
                if tier is not None:  # a stale copy of a state that is back on the GPU
                    self.tiers.delete(conv.id)
                tier = None
            else:
                meta = self.tiers.meta(conv.id)
        if tier is None:
            self._make_room(conv, conv.kv.lengths, new_tokens, wait_for_packs)
            self.resident[conv.id] = conv
            self.resident.move_to_end(conv.id)
            return
        n = meta["state"]["next_position"]
        c = self.llm.config
        estimate = self._disk_estimate(meta) if tier == "disk" else None
        # A restore that prefills needs the whole history at once; one that loads, what was stored.
        stored = meta["state"].get("lengths")
        recomputes = estimate is not None and estimate["recompute_s"] < estimate["read_s"]
        if stored is None or meta["strategy"]["name"] == "recompute" or recomputes:
            stored = [[n] * c.num_kv_heads for _ in range(c.num_layers)]
        self._make_room(conv, np.asarray(stored, dtype=np.int64), new_tokens, wait_for_packs)
        # Under the lock from the read until the restore's copies are registered in _pending: the
        # packer's thread never demotes an entry whose host memory a restore may still be reading.
        with self.lock:
            if recomputes:
                strategy, tensors, state = Recompute(), {}, full_layout_meta(c.num_layers, c.num_kv_heads, n)
                self.events.append({"conversation": conv.id, "event": "disk_state_recomputed", **estimate})
            else:
                try:
                    _, meta, tensors = self.tiers.get(conv.id)
                    strategy = strategy_of(meta["strategy"])
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
        with self.lock:
            if self.tiers.tier_of(conv.id) is not None:
                self.tiers.delete(conv.id)
        if conv.recipe.state.offloads_between_turns:
            if self.packer is not None and conv.id in self.resident:
                self._leave(conv, "cpu", stay=self.resident_packs)
                return
            try:
                self.offload(conv, "cpu")
            except StateTiersFullError as e:  # it stays on the GPU: nothing is lost
                self.events.append({"conversation": conv.id, "event": "kept_on_gpu", "error": str(e)})

    def offload(self, conv, tier: str = "cpu") -> str:
        """Store the conversation's state in `tier` (or lower) and free its GPU pages; returns the
        tier it landed in. On StateTiersFullError (no tier has room, or no GPU memory to stage the
        copy) the conversation stays as it was. A conversation being packed in the background is
        waited for first."""
        if conv.id in self.leaving:
            self._land(self.leaving.pop(conv.id))
        self._settle(conv)
        where = self.where(conv)
        if where is None:
            return "gpu"  # nothing to store yet
        if where != "gpu":
            with self.lock:
                if where == "cpu" and tier == "disk":
                    self.tiers.demote(conv.id)
                return self.tiers.tier_of(conv.id)
        if conv.id in self.copies:  # a tier holds its current state already: only the pages go
            self.copies.discard(conv.id)
            with self.lock:
                held = self.tiers.tier_of(conv.id)
                if held == "cpu" and tier == "disk":
                    self.tiers.demote(conv.id)
                    held = "disk"
            if held is not None:
                conv.kv.free()
                del self.resident[conv.id]
                return held
        strategy = conv.recipe.state
        window = conv.method_state.window
        stored = self._pack(conv, strategy, window, tier, self.ctx, strategy.prepare(self.ctx, conv.kv, window, tier))
        self._note_fallback(conv, strategy, stored.meta)
        tensors, state = with_window(stored, window)
        with self.lock:
            landed = self.tiers.put(conv.id, entry_meta(conv.to_record(), strategy, state), tensors, tier,
                                    keep=set(self._pending), spare=self.copies)
        conv.kv.free()
        del self.resident[conv.id]
        return landed

    # ---- packs in the background ------------------------------------------------------------
    def _leave(self, conv, tier: str, stay: bool = False) -> None:
        """Hand the store of a resident, idle conversation to the packer; it is "leaving" until
        land_packs takes the finished pack. What the pack reads that this thread's stream may still
        write or free is settled here: pending window steps are filed, the device page table is
        made current, and the window's tensors are held until the pack's stream is done with them.
        stay: a resident pack (pack_in_background): the conversation stays resident, and its copy goes
        to the CPU tier only where it fits beside the sole copies of others (spare ones aside)."""
        strategy = conv.recipe.state
        window = conv.method_state.window
        held = window.snapshot() if window is not None else None  # files pending steps too
        conv.kv.device_table()
        self.calibrate_for(strategy, tier)
        ctx = copy.copy(self.ctx)  # its own stage_on_host
        record = conv.to_record()
        # Under tensor parallelism the pack's collectives run here, in the ranks' common order.
        prepared = strategy.prepare(ctx, conv.kv, window, tier) if self.lockstep else None

        def device_work():
            stored = self._pack(conv, strategy, window, tier, ctx, prepared)
            tensors, state = with_window(stored, window)
            _ = held  # the window's tensors stay referenced until the stream has read them
            # Straight into the CPU tier's pinned pool: no pinned staging copy, and no host-to-host copy
            # under the lock the worker's admission takes.
            views = None
            if tier == "cpu":
                with self.lock:
                    views = self.tiers.reserve(conv.id, tensors, keep=set(self._pending),
                                               spare=self.copies - {conv.id}, demote=not stay)
            if views is None and stay:
                raise StateTiersFullError(f"no room beside the stored conversations for a copy of {conv.id}")
            if views is None:
                return stored.meta, {name: to_host(t) for name, t in tensors.items()}, state, False
            try:
                for name, t in tensors.items():
                    views[name].copy_(t, non_blocking=True)  # the packer synchronizes its stream after
            except BaseException:
                with self.lock:
                    self.tiers.release_reserved(views)
                raise
            return stored.meta, views, state, True

        def host_work(packed):
            pack_meta, tensors, state, reserved = packed
            meta = entry_meta(record, strategy, state)
            with self.lock:
                landed = (self.tiers.put_reserved(conv.id, meta, tensors) if reserved else
                          self.tiers.put(conv.id, meta, tensors, tier, keep=set(self._pending), spare=self.copies))
            return landed, pack_meta

        if not stay:
            del self.resident[conv.id]
        leaving = Leaving(conv, tier, strategy, stay=stay)
        leaving.job = self.packer.submit(device_work, host_work)
        self.leaving[conv.id] = leaving
        leaving.job.future.add_done_callback(self._pack_finished)

    def watch_packs(self, fn) -> Callable[[], None]:
        """Call fn() whenever a pack submitted from now on finishes (on the packer's thread, once the
        pack is done: land_packs then takes it); returns what stops that."""
        self._pack_watchers.append(fn)
        return lambda: self._pack_watchers.remove(fn) if fn in self._pack_watchers else None

    def _pack_finished(self, _future) -> None:
        for fn in list(self._pack_watchers):
            fn()

    def hurry(self, conv) -> None:
        """Run the conversation's pack next, if it is leaving and its pack has not started."""
        leaving = self.leaving.get(conv.id)
        if leaving is not None:
            self.packer.hurry(leaving.job)

    def check_not_leaving(self, conv) -> None:
        """PackInFlight, after moving its pack to the front, when the conversation is being packed
        and its pack has not finished: a caller that must not wait (the server's worker) retries
        after land_packs has taken it."""
        self._cancel_copy(conv)
        leaving = self.leaving.get(conv.id)
        if leaving is not None and not leaving.job.future.done():
            self.packer.hurry(leaving.job)
            raise PackInFlight(f"conversation {conv.id} is being packed")

    def _cancel_copy(self, conv) -> None:
        """A resident pack of `conv` that has not started is dropped: the turn coming back would make
        its copy stale before it is used."""
        leaving = self.leaving.get(conv.id)
        if leaving is not None and leaving.stay and self.packer.cancel(leaving.job):
            del self.leaving[conv.id]

    def land_packs(self, block: bool = False) -> list[dict]:
        """Take every finished pack: free the pages of each conversation a tier now holds, and keep
        on the GPU (resident, idle) one no tier could take. With `block`, first wait until at least
        one pack has finished, when any is in flight. Returns per conversation taken
        {"conversation", "tier" ("gpu" when kept), "bytes" stored, "pack_s" on the packer}."""
        if block:
            self.wait_for_a_pack()
        return self.land(self.packs_done())

    def wait_for_a_pack(self) -> None:
        """Until at least one pack in flight has finished (at once when none is in flight)."""
        if self.leaving and not any(x.job.future.done() for x in self.leaving.values()):
            concurrent.futures.wait([x.job.future for x in self.leaving.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def packs_done(self) -> list[str]:
        """The conversations whose pack has finished and is not taken yet, oldest first."""
        return [cid for cid, x in self.leaving.items() if x.job.future.done()]

    def land(self, conversation_ids: list[str]) -> list[dict]:
        """Take the packs of these leaving conversations, in order, waiting for those not finished
        (under tensor parallelism rank 0 names them: those finished there); as land_packs."""
        return [self._land(self.leaving.pop(cid)) for cid in conversation_ids if cid in self.leaving]

    def _land(self, leaving: Leaving) -> dict:
        """Wait for one pack and take it (leaving was popped from self.leaving)."""
        conv, job = leaving.conv, leaving.job
        concurrent.futures.wait([job.future])
        info = {"conversation": conv.id, "tier": "gpu", "bytes": 0, "pack_s": job.seconds}
        try:
            landed, pack_meta = job.future.result()
        except (StateTiersFullError, concurrent.futures.CancelledError) as e:  # it stays on the GPU
            self.events.append({"conversation": conv.id, "event": "kept_on_gpu", "error": str(e)})
            self.resident[conv.id] = conv
            return info
        except Exception as e:  # a failed pack loses nothing: the pages are still there
            log.warning("conversation %s: its pack failed, it stays on the GPU: %s", conv.id, e)
            self.events.append({"conversation": conv.id, "event": "pack_failed", "error": str(e)})
            self.resident[conv.id] = conv
            return info
        self._note_fallback(conv, leaving.strategy, pack_meta)
        if leaving.stay:
            self.copies.add(conv.id)  # stays resident: its pages go when the pool needs them (offload)
        else:
            conv.kv.free()  # the packer's stream is done reading the pages
        with self.lock:
            info.update(tier=landed, bytes=self.tiers.stored_bytes(conv.id) if self.tiers.tier_of(conv.id) else 0)
        return info

    # ---- packing ----------------------------------------------------------------------------
    def _note_fallback(self, conv, strategy, pack_meta: dict) -> None:
        if "fallback" in pack_meta:  # the strategy stored it by a baseline it predicts to be faster
            self.events.append({"conversation": conv.id, "event": "state_fallback", "strategy": strategy.name,
                                "to": pack_meta["fallback"], "predicted_s": pack_meta.get("predicted_s")})

    @staticmethod
    def _pack(conv, strategy, window, tier: str, ctx, prepared=None):
        """strategy.pack (from `prepared`, strategy.prepare's result; None: it prepares), which stages
        the state's rows on the GPU before they go down; where that finds no GPU memory (an offload to
        make room), again one layer at a time through host memory. StateTiersFullError when even that
        fails; the pages are untouched either way."""
        for on_host in (False, True):
            ctx.stage_on_host = on_host
            try:
                return strategy.pack(ctx, conv.kv, window, tier, prepared)
            except torch.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                error = str(e).splitlines()[0]
            finally:
                ctx.stage_on_host = False
        raise StateTiersFullError(f"no GPU memory to stage conversation {conv.id}'s state for the copy down ({error})")

    def discard(self, conv) -> None:
        """Forget a conversation's stored state (reset, close). A pack of it that has not started is
        cancelled; one that runs is waited for (the caller frees the pages next)."""
        leaving = self.leaving.pop(conv.id, None)
        if leaving is not None and not self.packer.cancel(leaving.job):
            self._land(leaving)
        self._settle(conv)
        self.resident.pop(conv.id, None)
        self.copies.discard(conv.id)
        with self.lock:
            self.tiers.delete(conv.id)

    def record(self, conversation_id: str) -> dict:
        """The history stored beside a conversation's state (Conversation.to_record), e.g. on disk
        before a restart; InvalidRequestError when none is stored under this id."""
        with self.lock:
            if self.tiers.tier_of(conversation_id) is None:
                hint = "" if self.tiers.disk is None else elsewhere_hint(*self.disk_root(), conversation_id)
                raise InvalidRequestError(f"no stored conversation has the id {conversation_id!r}{hint}")
            return self.tiers.meta(conversation_id)["conversation"]

    def disk_root(self) -> tuple[Path, int]:
        """(state_disk_dir, the engine's tensor-parallel size): the disk tier is this rank's folder in
        it (turnkv/parallel/disk_layout.py)."""
        size = self.llm.parallel.size if self.lockstep else 1
        return root_of(self.tiers.disk.dir, size), size

    # ---- internals --------------------------------------------------------------------------
    def _disk_estimate(self, meta: dict) -> dict | None:
        """Seconds to read a disk entry (at the store's measured rate; its copy to the device and any
        recompute its strategy adds come on top, so this is a lower bound) against seconds to
        recompute its history; None where recompute would not rebuild the same state, or before the
        disk's rate is known (the first read measures it)."""
        disk = self.tiers.disk
        if not meta["state"].get("recomputable") or disk is None or not disk.read_rate or self.lockstep:
            return None
        n = meta["state"]["next_position"]
        cost = self.ctx.cost("disk")
        recompute_s = float(cost.compute_s(np.full(self.llm.config.num_layers, n)))
        return {"read_s": float(meta["nbytes"]) / disk.read_rate, "recompute_s": recompute_s}

    def _settle(self, conv) -> None:
        """Wait for a restore's copies, so its sources can be freed or reused."""
        with self.lock:  # until they are done, the packer's thread must not demote the source
            stream = self._pending.pop(conv.id, None)
            if stream is not None:
                stream.synchronize()

    def _make_room(self, conv, lengths: np.ndarray, new_tokens: int, wait_for_packs: bool = True) -> None:
        """Demote least recently used resident conversations until `conv`, holding `lengths` tokens
        per [layer, KV head] (its own, or its stored state's), can add `new_tokens` to every head.
        A compressed conversation needs pages for what it keeps, not for its positions. Packs done
        in the background land first; with wait_for_packs, those in flight are waited for last."""
        pool = self.llm.pool
        pages = -(-(np.asarray(lengths) + new_tokens) // pool.page_size) + 1  # [L, H]: one page of slack a head
        need = np.maximum(pages - conv.kv.num_pages, 0).sum(axis=1)  # [L] pages to add per layer
        need_bytes = int(need.sum()) * pool.page_bytes

        if not self.lockstep:  # under tensor parallelism which packs are done is rank 0's to say
            self.land_packs()

        def short() -> bool:
            # Pages only a cache holds (the prefix index) go first. Decided alike on every rank of a
            # tensor-parallel engine (PagePool.room), whose pools may fill unevenly: the ranks demote
            # the same conversations.
            over_budget = False
            if self.gpu_memory is not None:
                held = sum(c.kv.bytes() for c in self.resident.values())
                held += sum(x.conv.kv.bytes() for x in self.leaving.values() if not x.stay)  # freed once landed
                over_budget = held + need_bytes > self.gpu_memory
            return not pool.room(need[None], most=0 if over_budget else None)

        # Those whose resident pack is in flight last: their offload waits for it.
        for victim_id in sorted(self.resident, key=lambda cid: cid in self.leaving):
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
        while wait_for_packs and self.leaving and short():  # their pages come back as they land
            if self.lockstep:
                self.land([next(iter(self.leaving))])  # the oldest, on every rank
            else:
                self.land_packs(block=True)
