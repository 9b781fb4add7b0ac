"""The worker's forwards (a base of the Scheduler, scheduler.py, on its worker thread): prefill slices,
decode steps, and mixed steps carrying decoding requests' tokens beside prefill slices, over the
scheduler's queues (prefilling, decoding), each retried while the store makes room for it.
Docs: the Scheduler's, scheduler.py."""

from __future__ import annotations

import time

from turnkv.engine import decode_loop, mixed
from turnkv.errors import KVCacheFullError
from turnkv.serve.admission import pick_slices
from turnkv.serve.engine_ops import Stepped
from turnkv.serve.job import Job


class Forwards:
    """Reads and changes the Scheduler's config, llm, ops, store, metrics, queues and _note; ends
    requests through its _finish and _fail."""

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
        flight land, waiting for each) to make room for it. Admission keeps a forward's room free of
        packs in flight (MemoryGate); the wait is for what it did not foresee (a restore into the
        pages a decode step then needs)."""
        while True:
            try:
                return step()
            except KVCacheFullError:
                if not self.store.evict_one(wait):  # it counts what it evicts in the metrics
                    raise
