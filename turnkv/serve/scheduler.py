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
docs/architecture.md): each iteration takes the finished ones, whose pages count as used until then.
Admission never waits for a pack: a request whose conversation is still being packed, or whose room
only packs in flight can give, keeps its place while the worker goes on, and when nothing else is to
be done the worker sleeps until a pack finishes (the packer wakes it); the next iteration takes the
room. A full pool sends idle conversations to the tiers (least recently used first); a prefill slice
or decode step short of room even so waits for a pack in flight; with neither, a prompt waits for
running requests, and a decode step ends its newest request (finish_reason "length", reply kept).
A prompt no pool of this size holds is a 400.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from turnkv.errors import KVCacheFullError
from turnkv.serve import slow_phases, worker_trace
from turnkv.serve.admission import MemoryGate
from turnkv.serve.errors import APIError
from turnkv.serve.forwards import Forwards
from turnkv.serve.job import Job
from turnkv.state.background import PackInFlight

log = logging.getLogger("turnkv.serve")


class Scheduler(Forwards):
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
        # Room waits: packs finished on the packer (counted on its thread) and their count when this
        # iteration began; whether room proved to come only from packs in flight, whether the held
        # requests wait for room coming back (packs, encodings), and the requests put back in line for
        # room, this iteration.
        self._packs_finished, self._mark, self._short, self._held_wait = 0, 0, False, False
        self._deferred: set[Job] = set()
        self._unwatch = lambda: None
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
        # Read here, on the caller's thread: a bad TURNKV_WORKER_TRACE_WINDOW fails the server's start
        # with its ValueError instead of killing the worker thread.
        self._trace = worker_trace.from_environment()  # TURNKV_WORKER_TRACE=folder: torch.profiler window
        self._unwatch = self.store.watch_packs(self._packed)
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
        cpu = slow_phases.thread_cpu_seconds()
        if cpu:  # which threads shared the interpreter with the worker, and how much
            log.info("threads' CPU seconds: %s", ", ".join(f"{name} {s:.1f}" for name, s in
                                                          sorted(cpu.items(), key=lambda kv: -kv[1])))

    # ---- worker --------------------------------------------------------------------------------------
    def _run(self) -> None:
        trace = self._trace
        with slow_phases.profiled_worker():  # TURNKV_WORKER_PROFILE=path: cProfile of this thread
            try:
                self._loop(trace)
            finally:
                if trace is not None:
                    trace.close()

    def _loop(self, trace) -> None:
        if trace is not None:
            trace.begin()
        while True:
            with self.cond:
                while not self._has_work():
                    self.cond.wait(1.0)
                    self._expire()
                if self._stop:
                    break
                queued = (*self.waiting, *self.encoding, *self.held, *self.prefilling, *self.decoding)
                gone = [j for j in queued if j.cancelled]
                self._mark, self._short, self._held_wait, self._deferred = self._packs_finished, False, False, set()
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
            if trace is not None:
                trace.step()
        self._unwatch()
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
        """Whether the worker has something to do now (under the lock). Requests waiting for room that
        only packs in flight (or requests still encoding) give back, held or put back in line, are not,
        until a pack finishes (or an encoding ends)."""
        if self._stop or self._flush_asked or self.prefilling or self.decoding:
            return True
        if self._short and self._packs_finished != self._mark:
            return True  # a pack finished: the next iteration takes its room
        if any(j.cancelled or j.encoding.done() for j in self.encoding):
            return True
        if any(j.cancelled for j in (*self.held, *self.waiting)) or (self.held and not self._held_wait):
            return True
        room = self.num_running < self.config.max_running
        return room and any(j not in self._deferred and not self.store.session_busy(j.session) for j in self.waiting)

    def _wake(self, *_) -> None:
        with self.cond:
            self.cond.notify()

    def _packed(self) -> None:
        """A pack finished (on the packer's thread): a worker waiting for room goes on."""
        with self.cond:
            self._packs_finished += 1
            self.cond.notify()

    def _short_of_packs(self) -> None:
        """Room proved to come only from packs in flight: until one finishes, what waits for room is no
        work (_has_work)."""
        self._short = self._short or bool(self.store.packing())

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
        """Claim each request's conversation, never waiting for a pack: one that cannot be claimed yet
        goes back to the front of the line, with its place, and is claimed again at a later iteration."""
        deferred = []
        for job in jobs:
            try:
                self._with_room(lambda j=job: j.claim(self.llm, self.store), wait=False)
            except PackInFlight:  # its conversation is still being packed (its pack now runs next)
                self._short_of_packs()
                deferred.append(job)
                continue
            except KVCacheFullError as e:  # no room to bring its conversation back yet: it waits for
                # packs in flight to land or for the other requests (those running or about to) to end
                if not (self.store.packing() or self.prefilling or self.decoding or self.held or self.encoding):
                    self._fail(job, e)
                    continue
                self._short_of_packs()
                job.abandon(self.store)
                deferred.append(job)
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
                self._deferred.update(deferred)

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
        conversation's, which admission counts as available, so the long prompt waits no longer.
        With none running, so may requests whose conversation holds pages (what it lacks); if none
        fits, one starts alone (_start_alone)."""
        blocked = False
        for job in list(self.held):
            running = self.prefilling + self.decoding
            if blocked and job.prefill_left > self.config.prefill_chunk and (running or not self.gate.held(job)):
                continue
            if self.gate.fits(job, running):
                self.held.remove(job)
                self.prefilling.append(job)
            else:
                blocked = True
        if self.held and not (self.prefilling or self.decoding):
            self._start_alone()

    def _start_alone(self) -> None:
        """None runs and no held request fits by the count: the first whose conversation holds pages
        (what the others lack), else the first in line, starts anyway (a prompt no pool holds was
        refused at ready()), unless the room is coming back: packs in flight hold pages (then the
        worker sleeps until one lands), or requests still encoding do (they are held next)."""
        if self.store.packing() or any(self.gate.held(j) for j in self.encoding):
            self._short_of_packs()  # a pack landing or an encoding ending wakes the worker
            self._held_wait = True
            return
        job = next((j for j in self.held if self.gate.held(j)), self.held[0])
        self.held.remove(job)
        self.prefilling.append(job)

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
