"""The processes of a tensor-parallel engine: rank 0 is the caller's, ranks 1..N-1 are workers it spawns.

SPMD: every rank builds the same engine over its shard of the model (turnkv/model/parallel.py) and
runs the same calls in the same order, so every collective of a forward meets its peers. Rank 0
takes the user's calls and sends each one to the workers before running it (turnkv/parallel/mirror.py);
the logits are gathered on every rank, so each samples the same token.

Failure: the collectives time out after `collective_timeout()` seconds (TURNKV_TP_TIMEOUT); those
run while the engines are built, after `build_timeout()` (TURNKV_TP_BUILD_TIMEOUT, by default the
same). Rank 0 waits for each worker's answer to every call with the collective timeout, checking
every 0.2 s that the worker lives: a dead or hung worker, or one that failed where rank 0 did not,
raises ParallelError on rank 0 and marks the engine broken (every later call raises it too).

The ranks' process group is their own (a TCP store on rank 0 and a gloo or NCCL group over it), not
torch.distributed's default group: a process may hold several engines, one after the other or at
once, and a caller's own default group is left alone.

Shutdown (`Leader.shutdown`, also at exit and when the engine is collected): each worker is told to
stop, joined for a few seconds, then terminated and killed if it lingers. Workers leave with
os._exit and tear nothing down (destroy_process_group hung after CUDA graphs with NCCL). On CUDA,
rank 0 then drops its CUDA graphs (which hold the NCCL communicator's captured work) and aborts its
side of the group; nothing calls destroy_process_group.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import socket
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from turnkv.errors import DeviceError, InvalidRequestError, ParallelError
from turnkv.model.config import ModelConfig
from turnkv.model.parallel import Shard, host_max
from turnkv.parallel.disk_layout import rank_dir
from turnkv.parallel.worker_loop import serve

TIMEOUT_ENV = "TURNKV_TP_TIMEOUT"
BUILD_TIMEOUT_ENV = "TURNKV_TP_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
STOP_WAIT_S = 5.0  # how long a stopping worker may take before it is terminated
# How long rank 0 waits for the workers to start (imports) and to build their engines (loading the
# model), checking meanwhile that they live: longer than a collective may take.
STARTUP_WAIT_S = 1800.0
POLL_S = 0.2


def collective_timeout() -> float:
    """Seconds a collective, or rank 0's wait for a worker's answer, may take: TURNKV_TP_TIMEOUT, else 600."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def build_timeout() -> float:
    """Seconds a collective may take while the engines are built (the ranks load their shards at
    their own pace): TURNKV_TP_BUILD_TIMEOUT, else collective_timeout()."""
    return _seconds(BUILD_TIMEOUT_ENV, collective_timeout())


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ParallelError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ParallelError(f"{name} must be positive, got {value}")
    return seconds


@dataclass
class Membership:
    """This process's place in a tensor-parallel engine: its rank, device and process group (over
    `store`); host_group: a gloo group of the same ranks for small host-side agreements (`agree`):
    `group` itself where that is gloo, else one formed beside it; leader: rank 0's link to the
    workers (None on a worker)."""

    rank: int
    size: int
    device: torch.device
    group: object
    store: object
    leader: Leader | None = None
    timeout: float = DEFAULT_TIMEOUT_S  # the collectives' limit once the engine is built
    group_timeout: float = DEFAULT_TIMEOUT_S  # the limit the group's collectives have now
    host_group: object = None

    def __post_init__(self):
        if self.host_group is None:
            self.host_group = self.group

    def built(self) -> None:
        """This rank's engine is built: from now on its collectives time out after `timeout` seconds
        (the groups were formed with build_timeout())."""
        if self.timeout != self.group_timeout:
            for group in {id(g): g for g in (self.group, self.host_group)}.values():
                group.set_timeout(timedelta(seconds=self.timeout))
            self.group_timeout = self.timeout

    def agree(self, values: list[int]) -> list[int]:
        """Each of `values` (ints) at its largest over the ranks: PagePool.agree. A collective over
        host_group with a host tensor, so no device stream waits for it (decode's CPU work stays ahead
        of the GPU); every rank calls it at the same point. Inside collectives_skipped (a CUDA
        graph's warm-up, which may run on one rank alone): the values as they are."""
        return host_max(values, self.host_group)

    def shard(self, config: ModelConfig) -> Shard:
        return Shard(self.rank, self.size, config, self.group)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective: every rank calls it at the same point, while
        building its engine). On rank 0, ParallelError naming a worker that failed before it."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:
            if self.leader is not None:
                self.leader.wait_ready()  # raises the worker's own error where one failed
            raise ParallelError(f"a rank of the tensor-parallel engine failed while it was built: {e}") from e
        return int(t)

    def disk_dir(self, state_disk_dir: str | None) -> str | None:
        """The rank's own folder under the engine's disk tier: each rank stores its shard of a conversation."""
        if state_disk_dir is None:
            return None
        return rank_dir(state_disk_dir, self.size, self.rank)


@dataclass
class _Seat:
    """What a worker process knows before its engine is built."""

    rank: int
    size: int
    port: int
    timeout: float
    build_timeout: float
    acks: object  # the queue of the workers' answers to rank 0


_SEAT: _Seat | None = None  # set in a worker process: it serves one rank of one engine for its whole life


def start(size: int, device: torch.device, engine_class: type, launch_args: dict) -> Membership | None:
    """Join a tensor-parallel engine of `size` ranks (None for size 1). On rank 0 (the caller's
    process): spawn the workers, each building engine_class(**launch_args), and form the process
    group with them. In a worker: form it with rank 0. Returns the membership, with this rank's device
    (cuda:rank on CUDA)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ParallelError(f"tensor_parallel must be an integer >= 1, got {size!r}")
    if size == 1:
        return None
    rank_device = _rank_device(device, size, _SEAT.rank if _SEAT is not None else 0)
    if _SEAT is not None:
        _SEAT.acks.put((_SEAT.rank, "joining", None))
        group, host_group, store = _join(_SEAT.rank, size, _SEAT.port, rank_device, _SEAT.build_timeout)
        return Membership(_SEAT.rank, size, rank_device, group, store, timeout=_SEAT.timeout,
                          group_timeout=_SEAT.build_timeout, host_group=host_group)
    timeout, building = collective_timeout(), build_timeout()
    port = _free_port()
    context = mp.get_context("spawn")
    commands = [context.Queue() for _ in range(size - 1)]
    acks = context.Queue()
    processes = []
    leader = Leader(processes, commands, acks, timeout)
    for rank in range(1, size):
        process = context.Process(target=_worker_main, daemon=True, name=f"turnkv-tp-rank{rank}",
                                  args=(rank, size, port, (timeout, building), engine_class, launch_args,
                                        commands[rank - 1], acks))
        try:
            process.start()  # pickles the arguments
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            leader.shutdown()
            raise ParallelError(f"the engine's arguments go to the worker processes pickled, and one cannot be: "
                                f"{e}") from None
        processes.append(process)
    try:
        # Every worker is about to join before rank 0 does: one that dies on its way there is
        # reported now, instead of making the rendezvous wait out its timeout.
        leader.expect("joining", "could not start")
        group, host_group, store = _join(0, size, port, rank_device, building)
    except BaseException:
        leader.shutdown()
        raise
    if rank_device.type == "cuda":
        leader.closers.append(functools.partial(_abort, group))
    return Membership(0, size, rank_device, group, store, leader, timeout=timeout, group_timeout=building,
                      host_group=host_group)


def _rank_device(device: torch.device, size: int, rank: int) -> torch.device:
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"tensor parallelism runs on cpu or cuda, not {device}")
    if device.index not in (None, 0):
        raise DeviceError(f"tensor_parallel={size} takes cuda:0 to cuda:{size - 1}; choose the GPUs with "
                          f"CUDA_VISIBLE_DEVICES instead of device={device}")
    if torch.cuda.device_count() < size:
        raise DeviceError(f"tensor_parallel={size} needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    return torch.device("cuda", rank)


def _join(rank: int, size: int, port: int, device: torch.device, timeout: float) -> tuple[object, object, object]:
    """(process group, host group, their store) of the engine's ranks; rank 0 serves the store. On CUDA
    the process group is NCCL's and the host group a gloo group beside it (its keys under their own
    prefix in the store); on CPU both are the one gloo group."""
    limit = timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, limit)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        host = dist.ProcessGroupGloo(dist.PrefixStore("host", store), rank, size, limit)
        return dist.ProcessGroupNCCL(store, rank, size, options), host, store
    group = dist.ProcessGroupGloo(store, rank, size, limit)
    return group, group, store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Leader:
    """Rank 0's link to its workers: a command queue each, one queue of their answers."""

    processes: list
    commands: list
    acks: object
    timeout: float
    broken: str | None = None  # why the engine cannot go on, once it cannot
    depth: int = 0  # > 0 while a mirrored call runs on rank 0: the calls it makes run on rank 0 alone
    streaming: bool = False  # a mirrored call's iterator is open on rank 0
    # What rank 0 lets go of once the workers are stopped, in order (on CUDA: the engine's CUDA graphs,
    # then the process group, aborted); each is called once, and what one raises is ignored.
    closers: list = field(default_factory=list)
    _finalizer: object = field(default=None, repr=False)

    def __post_init__(self):
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.commands, self.closers)

    def check(self) -> None:
        """ParallelError if the engine is broken or a worker has exited."""
        if self.broken is None:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    self.broken = f"rank {rank} exited (exit code {process.exitcode})"
                    break
        if self.broken is not None:
            raise ParallelError(f"the tensor-parallel engine is broken: {self.broken}; make a new engine")

    def send(self, command: tuple) -> None:
        """Send a command to every worker. InvalidRequestError, with nothing sent, when its arguments
        cannot be pickled (a queue would fail to send it later, in its own thread, unseen)."""
        self.check()
        try:
            payload = pickle.dumps(command)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises, the caller gets one error
            raise InvalidRequestError(f"the arguments of a call to a tensor-parallel engine go to its workers pickled, "
                                      f"and these cannot be ({e}); give a recipe as a string") from None
        for q in self.commands:
            q.put(payload)

    def post(self, command: tuple) -> None:
        """Send a command that answers nothing, unless the engine is already broken or stopped."""
        if self.broken is None and self._finalizer.alive:
            for q in self.commands:
                q.put(command)

    def answers(self, timeout: float | None = None) -> dict[int, tuple[str, object]]:
        """Each worker's answer to the last command: {rank: (kind, detail)}. ParallelError when a worker
        exits or stays silent past `timeout` seconds (default: the collective timeout)."""
        got: dict[int, tuple[str, object]] = {}
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(got) < len(self.processes):
            try:
                rank, kind, detail = self.acks.get(timeout=POLL_S)
                got[rank] = (kind, detail)
                continue
            except queue.Empty:
                pass
            for rank, process in enumerate(self.processes, start=1):
                if rank not in got and not process.is_alive():
                    self.fail(f"rank {rank} exited (exit code {process.exitcode})")
            if time.monotonic() > deadline:
                silent = sorted(set(range(1, len(self.processes) + 1)) - set(got))
                self.fail(f"rank(s) {silent} did not answer within {timeout:.0f} s")
        return got

    def fail(self, why: str) -> None:
        self.broken = why
        raise ParallelError(f"the tensor-parallel engine is broken: {why}; make a new engine")

    def wait_ready(self) -> None:
        """Wait for every worker's engine to be built; ParallelError naming the first that failed."""
        self.expect("ready", "could not build its engine")

    def expect(self, kind: str, failure: str) -> None:
        """Wait (up to STARTUP_WAIT_S) for every worker's answer; ParallelError unless each is `kind`."""
        for rank, (got, detail) in sorted(self.answers(STARTUP_WAIT_S).items()):
            if got != kind:
                self.fail(f"rank {rank} {failure}: {detail}")

    def shutdown(self) -> None:
        """Stop the workers and leave the process group; safe to call twice."""
        self._finalizer()


def _abort(group) -> None:
    """End rank 0's side of an NCCL group without tearing it down with its peers (they are stopped)."""
    torch.cuda.synchronize()
    group.abort()


def _stop(processes: list, commands: list, closers: list) -> None:
    for q in commands:
        try:
            q.put(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for close in closers:
        try:
            close()
        except Exception:  # noqa: BLE001 - at exit or collection: nowhere to raise it, and the workers are gone
            pass


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _worker_main(rank: int, size: int, port: int, timeouts: tuple[float, float], engine_class: type,
                 launch_args: dict, commands, acks) -> None:
    """A worker's life: build the engine for its rank, then run rank 0's commands until told to stop
    or rank 0's process is gone. timeouts: (collective_timeout(), build_timeout()) of rank 0."""
    global _SEAT
    _SEAT = _Seat(rank, size, port, *timeouts, acks)
    code = 0
    try:
        try:
            engine = engine_class(**launch_args)
        except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
            acks.put((rank, "failed", _describe(e)))
            code = 1
            return
        engine.parallel.built()
        acks.put((rank, "ready", None))
        serve(rank, engine, commands, acks)
    finally:
        acks.close()
        acks.join_thread()
        os._exit(code)
