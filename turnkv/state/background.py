"""Packs of conversations leaving the GPU, run on a thread of their own instead of the caller's.

A strategy that stores a conversation after every turn (state=krul, load, ...) packs its KV then: a
copy of the whole state to the host, and for Krul its attention estimator where a pairing could make
its plan win. On the server's worker thread every running stream would wait for it. With a Packer (StateManager.pack_in_background)
the state manager hands the pack over instead, and the worker goes on.

The contract between the submitting thread and the packer:
- the conversation's pages stay allocated, and untouched, until the submitter takes the finished
  job (StateManager.land_packs): nothing overwrites what the pack reads;
- the pack's stream waits for everything the submitting thread's stream issued before submit()
  (the turn's last K/V writes and recorded queries);
- the device work runs on the packer's own CUDA stream, which is synchronized before the job's future
  completes: once it is done, the device has finished every read of the pages (then they may be freed)
  and the results are on the host;
- the device work holds CAPTURE_LOCK (a CUDA graph capture on the worker would fail on this thread's
  calls); the host work after it (storing into the tiers) does not;
- a job runs no collective (one raises RuntimeError): under tensor parallelism each rank's packer
  runs on its own time, so the submitter runs a pack's collectives first (StateStrategy.prepare).
Jobs run one at a time, in the order submitted, but a job may be moved to the front (`hurry`) or
taken out before it starts (`cancel`). On a CPU device the same thread runs the same work.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from turnkv.capture_lock import CAPTURE_LOCK
from turnkv.errors import TurnkvError
from turnkv.model.parallel import collectives_refused


class PackInFlight(TurnkvError):
    """The conversation's state is still being packed on the packer's thread. Nothing was changed;
    ask again once the pack has landed (StateManager.land_packs)."""


class PackJob:
    """One pack: `device_work()` on the packer's stream, then `host_work(its result)`; `future` holds
    host_work's result (or its exception); `seconds` the job's wall time on the packer's thread."""

    def __init__(self, device_work: Callable[[], object], host_work: Callable[[object], object] | None,
                 ready: torch.cuda.Event | None):
        self.device_work, self.host_work, self.ready = device_work, host_work, ready
        self.future: Future = Future()
        self.seconds = 0.0


class Packer:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._queue: deque[PackJob] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.completed = 0  # jobs run to their end (with or without an exception)
        self.busy_s = 0.0  # their seconds on the packer's thread

    def submit(self, device_work: Callable[[], object], host_work: Callable[[object], object] | None = None) -> PackJob:
        """Queue a job; its device work starts after everything issued so far on the calling
        thread's current stream."""
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        job = PackJob(device_work, host_work, ready)
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="turnkv-pack", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cond.notify()
        return job

    def hurry(self, job: PackJob) -> None:
        """Run `job` next, if it has not started."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self._queue.appendleft(job)

    def cancel(self, job: PackJob) -> bool:
        """Take out a job that has not started (its future is cancelled); False when it runs or ran."""
        with self._cond:
            if job not in self._queue:
                return False
            self._queue.remove(job)
        job.future.cancel()
        return True

    def queued(self) -> int:
        """Jobs submitted that have not started."""
        with self._cond:
            return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                # Under tensor parallelism the ranks' packers run apart: a collective here would wait for
                # ranks that never join it (StateStrategy.prepare runs those on the submitting thread).
                with collectives_refused("a pack on the packer's thread"):
                    out = self._device(job)
                    result = job.host_work(out) if job.host_work is not None else out
            except BaseException as e:  # the submitter sees it when it takes the job
                job.seconds = time.perf_counter() - start
                job.future.set_exception(e)
            else:
                job.seconds = time.perf_counter() - start
                job.future.set_result(result)
            self.completed += 1
            self.busy_s += job.seconds

    def _device(self, job: PackJob):
        with CAPTURE_LOCK, torch.no_grad():
            if not self.cuda:
                return job.device_work()
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self.stream.wait_event(job.ready)
                try:
                    return job.device_work()
                finally:  # also on failure: the pages may be freed once the job is done
                    self.stream.synchronize()
