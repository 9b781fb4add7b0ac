"""The worker: one thread makes every model call, so torch never runs on the asyncio loop and the KV
pool has a single writer.

Each iteration:
1. requests whose client went away are dropped, and their turn undone;
2. waiting requests are admitted while fewer than --max-running run: each finds its conversation
   (the store), its new tokens are encoded on the encoder thread (a huge request never stalls decode
   steps), and it starts its prefill once the KV pool holds what it will add beside the running
   requests' headroom (admission.py; in arrival order);
3. while requests decode, ONE forward (a mixed step, engine/mixed.py) carries every decoding
   request's next token plus whole prefill slices, in arrival order, as many as fit in
   `max_step_tokens` (at least one): a long prompt adds at most its slices to the running streams'
   inter-token gap. A step carries at most one slice that ends a prompt its recipe compresses.
   Selecting decodes (LServe, LoopServe, Quest) take a graphed decode step beside it. With
   max_step_tokens 0, a slice runs alone, then one batched decode step (runner.decode, CUDA graphs);
4. when nothing decodes, prompts prefill slice by slice until the first of them decodes. Slice
   boundaries are multiples of `prefill_chunk` whatever the load, so a request's tokens do not
   depend on it.
Packs of conversations leaving the GPU (state=krul, ...) run beside the worker (state/background.py;
docs/architecture.md): each iteration takes the finished ones, whose pages count as used until then,
and a request whose conversation is still being packed keeps its place until its pack lands.
A full pool sends idle conversations to the tiers (least recently used first), then waits for a pack
in flight; with neither, a prompt waits for running requests, and a decode step ends its newest
request (finish_reason "length", reply kept). A prompt no pool of this size holds is a 400.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from turnkv.engine import decode_loop, mixed
from turnkv.errors import KVCacheFullError
from turnkv.serve import slow_phases
from turnkv.serve.admission import MemoryGate, pick_slices
from turnkv.serve.engine_ops import Stepped
from turnkv.serve.errors import APIError
from turnkv.serve.job import Job
from turnkv.state.background import PackInFlight

log = logging.getLogger("turnkv.serve")


class Scheduler:
    def __init__(self, llm, store, config, metrics):
        self.llm, self.store, self.config, self.metrics = llm, store, config, metrics
        slow_phases.watch()  # a slow phase names the Triton kernels it compiled
        self.ops = getattr(store, "ops", None)  # every change to the engine goes through it (engine_ops.py)
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.encoding: list[Job] = []  # admitted, their new tokens being encoded
        self.held: list[Job] = []  # encoded and their turn begun, waiting for KV memory (arrival order)
        self.prefilling: list[Job] = []
        self.decoding: list[Job] = []
        self.accepting = True
        self._stop = False
        self._flush_asked = False
        self._note = ""  # what the current phase's step carried, for the slow-phase log
        self._flushed = threading.Event()
        self._flush_count = (0, 0)
        self._expired_at = time.monotonic()
        self.thread: threading.Thread | None = None
        self.gate = MemoryGate(llm.pool, store, slice_tokens=min(self.config.prefill_chunk, llm.runner.prefill_chunk))

    # ---- HTTP side -----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.encoding) + len(self.held) + len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def submit(self, job: Job) -> None:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        with self.cond:
            if not self.accepting:
                self.metrics.labels(self.metrics.rejected, "draining").inc()
                raise APIError(503, "the server is shutting down", type="server_error", code="draining", headers=retry)
            if self.num_running + len(self.waiting) >= self.config.max_running + self.config.max_waiting:
                self.metrics.labels(self.metrics.rejected, "queue_full").inc()
                raise APIError(429, f"the server is busy ({self.config.max_running} requests running, "
                               f"{self.config.max_waiting} waiting); retry after {self.config.retry_after_s} s",
                               type="rate_limit_error", code="queue_full", headers=retry)
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the worker undoes the request at its next iteration."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def flush(self, timeout: float = 10.0) -> tuple[int, int]:
        """Drop every idle conversation and the prefix index's entries (on the worker, between two
        steps); returns (conversations, index entries) dropped (store.flush)."""
        self._flushed.clear()
        with self.cond:
            self._flush_asked = True
            self.cond.notify()
        self._flushed.wait(timeout)
        return self._flush_count

    def start(self) -> None:
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnkv-encode")
        self.thread = threading.Thread(target=self._run, name="turnkv-worker", daemon=True)
        self.thread.start()

    def begin_drain(self) -> None:
        with self.cond:
            self.accepting = False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is queued or running (at most `timeout` s); True if none is."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.waiting or self.num_running:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return False
                self.cond.wait(min(left, 0.05))
        return True

    def stop(self, timeout: float) -> None:
        """Refuse new requests, let the admitted ones finish (up to `timeout`), then stop the worker, which
        hands idle conversations to the durable tier (store.shutdown)."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        with self.cond:
            while (self.waiting or self.num_running) and time.monotonic() < deadline:
                self.cond.wait(0.05)
            self._stop = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()

    # ---- worker --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._has_work():
                    self.cond.wait(1.0)
                    self._expire()
                if self._stop:
                    break
                queued = (*self.waiting, *self.encoding, *self.held, *self.prefilling, *self.decoding)
                gone = [j for j in queued if j.cancelled]
            # A cancelled request counts as running until its turn is undone and its KV is back.
            for job in gone:
                self.metrics.labels(self.metrics.failed, "disconnected").inc()
                self._safely(job.abandon, self.store)
            with self.cond:
                for job in gone:
                    self._remove(job)
                admitted = self._pop_admissible()
            if self._flush_asked:
                self._flush_asked = False
                self._flush_count = self.store.flush()
                self._flushed.set()
            self._expire()
            try:
                # Packs finished on the background packer give their pages back (cheap when none did).
                self.store.settle()
                with self._timed("admit", admitted or self.encoding or self.held):
                    self._admit(admitted)
                    self._encoded()
                    self._start_prefills()
                if self.decoding and self.prefilling and self.config.max_step_tokens:
                    with self._timed("mixed"):
                        self._mixed()
                else:
                    with self._timed("prefill", self.prefilling):
                        self._prefill()
                    with self._timed("decode", self.decoding):
                        self._decode()
            except Exception as e:  # a bug, not bad input: fail what is in flight and keep serving
                log.exception("worker step failed")
                for job in [*(j for j in admitted if j not in self.waiting and j not in self.encoding),
                            *self.encoding, *self.held, *self.prefilling, *self.decoding]:
                    self._fail(job, e)
                self.encoding, self.held, self.prefilling, self.decoding = [], [], [], []
            with self.cond:
                self.cond.notify_all()  # stop() waits for the queue to empty
        for job in [*self.waiting, *self.encoding, *self.held, *self.prefilling, *self.decoding]:
            self._fail(job, APIError(503, "the server stopped", type="server_error"))
        self.encoder.shutdown(wait=True, cancel_futures=True)
        try:
            kept, dropped = self.store.shutdown()
        except Exception:  # the engine broke (a tensor-parallel worker died): nothing left to hand over
            log.exception("could not hand the idle conversations over")
            return
        if kept or dropped:
            log.info("stopped: %d idle conversations kept in the durable tier, %d dropped", kept, dropped)

    def _timed(self, phase: str, work=True):
        """The phase in /metrics, when it had `work` to do, and logged when slow (slow_phases.py)."""
        self._note = ""  # what the step carried, set by the phase
        return slow_phases.timed(self.metrics, phase, bool(work),
                                 lambda: (len(self.decoding), len(self.prefilling), self._note))

    def _has_work(self) -> bool:
        """Whether the worker has something to do now (under the lock)."""
        if self._stop or self._flush_asked or self.held or self.prefilling or self.decoding:
            return True
        if any(j.cancelled or j.encoding.done() for j in self.encoding):
            return True
        room = self.num_running < self.config.max_running
        return any(j.cancelled or (room and not self.store.session_busy(j.session)) for j in self.waiting)

    def _wake(self, *_) -> None:
        with self.cond:
            self.cond.notify()

    def _expire(self) -> None:
        now = time.monotonic()
        if now - self._expired_at >= 1.0:
            self._expired_at = now
            for _ in range(self.store.expire()):
                self.metrics.labels(self.metrics.evictions, "idle_ttl").inc()

    def _pop_admissible(self) -> list[Job]:
        """Waiting requests that fit in the batch, in arrival order; a request whose session is busy
        stays queued (with its place) until that session's request ends."""
        room = self.config.max_running - self.num_running
        taken, kept = [], deque()
        while self.waiting and room > 0:
            job = self.waiting.popleft()
            if job.session is not None and (self.store.session_busy(job.session)
                                            or any(j.session == job.session for j in taken)):
                kept.append(job)
                continue
            taken.append(job)
            room -= 1
        self.waiting.extendleft(reversed(kept))
        return taken

    def _admit(self, jobs: list[Job]) -> None:
        deferred = []
        for job in jobs:
            try:
                # Without waiting for packs in flight: short of room, it waits in line instead.
                self._with_room(lambda j=job: j.claim(self.llm, self.store), wait=False)
            except PackInFlight:
                # Its conversation is still being packed (its pack now runs next): it keeps its place
                # and is claimed again at a later iteration, while the running streams go on; with
                # none prefilling or decoding, the worker waits for the pack here instead of spinning.
                if not (self.prefilling or self.decoding):
                    self.store.settle(block=True)
                deferred.append(job)
                continue
            except KVCacheFullError as e:  # no room to bring its conversation back while others run:
                # it waits for them (or for packs in flight to land), with its place
                if not (self.prefilling or self.decoding) and not self.store.settle(block=True):
                    self._fail(job, e)
                    continue
                job.abandon(self.store)
                with self.cond:
                    self.waiting.appendleft(job)
                continue
            except Exception as e:
                self._fail(job, e)
                continue
            job.encoding = self.encoder.submit(job.encode, self.llm)
            self.encoding.append(job)
            job.encoding.add_done_callback(self._wake)
        if deferred:
            with self.cond:
                self.waiting.extendleft(reversed(deferred))

    def _encoded(self) -> None:
        """Requests whose tokens are encoded begin their turn, and wait for KV memory."""
        for job in [j for j in self.encoding if j.encoding.done()]:
            self.encoding.remove(job)
            try:
                job.ready(self.llm, job.encoding.result())
            except Exception as e:
                self._fail(job, e)
                continue
            job.encoding = None
            self.held.append(job)

    def _start_prefills(self) -> None:
        """Held requests start their prefill, in arrival order, while the pool holds what each will
        add beside the headroom of those running (admission.py). Behind one that does not fit, only
        short prompts (at most one prefill chunk, such as a later turn of a kept conversation) may
        start, if they fit: each runs for a reply's length, after which its pages are an idle
        conversation's, which admission counts as available, so the long prompt waits no longer."""
        blocked = False
        for job in list(self.held):
            if blocked and job.prefill_left > self.config.prefill_chunk:
                continue
            if self.gate.fits(job, self.prefilling + self.decoding):
                self.held.remove(job)
                self.prefilling.append(job)
            else:
                blocked = True

    def _slice(self, job: Job) -> int:
        """The size of the job's next prefill slice: up to the next multiple of prefill_chunk in its
        prompt (the runner's own chunk caps it), so boundaries never depend on load."""
        chunk = self.config.prefill_chunk
        return min(chunk - job.turn.prefilled % chunk, self.llm.runner.prefill_chunk)

    def _prefill(self) -> None:
        """Prefill slices in arrival order until a decode step is due: while requests decode, after one
        prefill_chunk of tokens; when none did, once the first prompt decodes (with mixed steps, the
        next iteration's mixed step carries the other prompts' slices beside it)."""
        budget = self.config.prefill_chunk if self.decoding or not self.config.max_step_tokens else 0
        spent = 0
        while self.prefilling and not (self.decoding and spent >= budget):
            job = self.prefilling[0]
            size = min(self._slice(job), job.prefill_left)
            try:
                piece, done = self._with_room(lambda: job.prefill(self._slice(job)))
            except KVCacheFullError as e:
                self.prefilling.pop(0)
                if self.decoding:  # memory comes back as they finish: wait for it, from the start
                    job.abandon(self.store)
                    with self.cond:
                        self.waiting.appendleft(job)
                    return
                self._fail(job, e)
                continue
            except Exception as e:
                self.prefilling.pop(0)
                self._fail(job, e)
                continue
            spent += size
            if job.prefill_left:
                continue
            self.prefilling.pop(0)
            self._first_token(job, piece, done)

    def _first_token(self, job: Job, piece: str, done: bool) -> None:
        m, now = self.metrics, time.perf_counter()
        m.labels(m.ttft).observe(now - job.arrived)
        job.last_token_at = now
        job.sink("start", None)
        job.emit(piece)
        try:  # the recipe's after-prompt hook (a compression), once the first token is on its way
            self._with_room(lambda: self.ops.settle(job.turn))
        except Exception as e:
            self._fail(job, e)
            return
        if done:
            self._finish(job)
        else:
            self.decoding.append(job)

    def _decode(self, decoding: list[Job] | None = None) -> None:
        """One step of the engine's step loop (engine/decode_loop.py) over the decoding requests (all
        of them by default), its forward retried here when the KV pool is full."""
        decoding = list(self.decoding if decoding is None else decoding)
        jobs = {id(job.turn): job for job in decoding}
        size = self.llm.runner.graph_batch or self.config.max_running  # batches the graphs replay
        for batch in decode_loop.batches([job.turn for job in decoding], size):
            self._decoded(batch, self._decode_step(batch, jobs), jobs)

    def _decoded(self, batch: list, step: Stepped, jobs: dict) -> None:
        """Each turn of a decode batch takes its token from its row of the step's logits [B, V] (or fails
        with what the step's hook raised for it: EngineOps.decode)."""
        logits, errors = step.value, step.errors
        self.metrics.labels(self.metrics.batch).observe(len(batch))
        now = time.perf_counter()
        for turn, row in zip(batch, logits):
            job = jobs[id(turn)]
            try:
                if id(turn) in errors:
                    raise errors[id(turn)]
                piece = self.ops.take(turn, row)
            except Exception as e:
                self.decoding.remove(job)
                self._fail(job, e)
                continue
            self.metrics.labels(self.metrics.itl).observe(now - job.last_token_at)
            job.last_token_at = now
            job.emit(piece)
            if turn.done:
                self.decoding.remove(job)
                self._finish(job)

    def _mixed(self) -> None:
        """One forward over every decoding request's next token and whole prefill slices of the
        prefilling prompts (engine/mixed.py), as many as fit in max_step_tokens, at least one. On a full
        pool with no idle conversation left to move, the step runs as a separate slice and decode step
        instead, which know what to give up. Requests whose decode selects take a graphed decode step
        first where graphs run (mixed.rides_mixed_step); the forward then carries the others' tokens."""
        riding, graphed = [], []
        for job in self.decoding:
            (riding if mixed.rides_mixed_step(self.llm.runner, job.turn) else graphed).append(job)
        graphed_start = time.perf_counter()
        if graphed:
            self._decode(graphed)
        graphed_note = f"; graphed decode of {len(graphed)} in {(time.perf_counter() - graphed_start) * 1000:.0f} ms"
        jobs = {id(job.turn): job for job in riding}
        batches = decode_loop.batches([job.turn for job in riding], self.config.max_running)
        parts = [mixed.decode_part(batch) for batch in batches]
        slices = self._pick_slices(self.config.max_step_tokens - sum(part.size for part in parts))
        ends = [job for job, part in slices if part.width >= job.prefill_left]
        start = time.perf_counter()
        try:
            step = self._with_room(lambda: self.ops.mixed(batches, [(job.turn, part.width) for job, part in slices]))
        except KVCacheFullError:
            self._prefill()
            self._decode([job for job in riding if job in self.decoding])
            return
        (logits, lasts), errors = step.value, step.errors
        self.metrics.labels(self.metrics.mixed_steps).inc()
        for batch, rows in zip(batches, logits):
            self._decoded(batch, Stepped(rows, errors), jobs)
        forward = time.perf_counter() - start  # sampling the decode tokens waited for the forward
        widths = [part.width for _, part in slices]
        self._note = (graphed_note * bool(graphed) + f"; forward {forward * 1000:.0f} ms over "
                      f"{sum(p.size for p in parts)} decode tokens and slices of {widths} tokens, "
                      f"then {len(ends)} prompt(s) ended")
        for (job, _), last in zip(slices, lasts):
            try:
                if id(job.turn) in errors:
                    raise errors[id(job.turn)]
                piece = None if last is None else self.ops.take(job.turn, last)
            except Exception as e:
                self.prefilling.remove(job)
                self._fail(job, e)
                continue
            if piece is not None:
                self.prefilling.remove(job)
                self._first_token(job, piece, job.turn.done)
        self._note += f" in {(time.perf_counter() - start - forward) * 1000:.0f} ms" if ends else ""

    def _pick_slices(self, budget: int) -> list:
        """(job, part) of the prefill slices a mixed step carries beside its decode tokens (admission.pick_slices)."""
        return pick_slices(self.prefilling, budget, self._slice)

    def _decode_step(self, batch: list, jobs: dict):
        """A decode step over `batch` (turns; jobs maps id(turn) to its request); on a full
        pool, idle conversations move to the tiers (or are dropped), then the newest request ends,
        until the step fits. A request ended so keeps the reply it has generated, with
        finish_reason "length" (the pool, like the context, holds no more of it). Returns the step
        (EngineOps.decode: logits, hook errors) of the turns still in `batch`."""
        while True:
            try:
                return self._with_room(lambda: self.ops.decode(batch))
            except KVCacheFullError:
                victim = max(batch, key=lambda t: jobs[id(t)].arrived)
                batch.remove(victim)
                self.decoding.remove(jobs[id(victim)])
                jobs[id(victim)].emit(self.ops.end(victim, "length"))
                self._finish(jobs[id(victim)])
                if not batch:
                    return Stepped([], {})

    def _with_room(self, step, wait: bool = True):
        """step(), retried while idle conversations leave the pool (and, with wait, while packs in
        flight land, waiting for each) to make room for it."""
        while True:
            try:
                return step()
            except KVCacheFullError:
                if not self.store.evict_one(wait):  # it counts what it evicts in the metrics
                    raise

    # ---- endings -----------------------------------------------------------------------------------
    def _finish(self, job: Job) -> None:
        try:
            with self._timed("finish"):
                outcome = job.finish(self.store)
        except Exception as e:
            self._fail(job, e)
            return
        self.metrics.request_done(outcome, time.perf_counter() - job.arrived)
        job.sink("done", outcome)

    def _fail(self, job: Job, error: Exception) -> None:
        self._safely(job.abandon, self.store)
        self.metrics.labels(self.metrics.failed, type(error).__name__).inc()
        job.sink("error", error)

    def _remove(self, job: Job) -> None:
        for queue in (self.waiting, self.encoding, self.held, self.prefilling, self.decoding):
            if job in queue:
                queue.remove(job)

    @staticmethod
    def _safely(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("could not undo a request cleanly")
