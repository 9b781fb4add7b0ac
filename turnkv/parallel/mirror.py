"""Rank 0 sends each public call of a tensor-parallel engine to its workers, then runs it itself.

`@mirrored` marks the engine's and its conversations' public methods that change state or run the
model (LLM.generate, LLM.conversation, Conversation.stream, ...). On rank 0 of a tensor-parallel
engine such a call is sent to every worker, which makes the same call on its own engine
(turnkv/parallel/worker_loop.py), and then runs on rank 0; rank 0 then waits for the workers'
answers and compares them with its own outcome. Elsewhere (one device, or on a worker) the method runs
as it is. Calls a mirrored call makes run on rank 0 alone: every worker makes them too.

Contracts:
- A call's arguments are pickled to the workers. A sampling call with temperature > 0 and no seed is
  given one on rank 0, so that every rank draws the same tokens.
- A method that returns a new object of the engine (a conversation) is answered by "adopt": the
  workers' object takes rank 0's `id`.
- A method that returns an iterator (Conversation.stream) is run to its end on the workers. On rank 0
  one call runs at a time: another mirrored call while such an iterator is open raises
  InvalidRequestError. Closing the iterator early runs the rest of the turn on rank 0 too, so that the
  ranks stay in step: the turn finishes instead of being undone (not yet supported under TP).
- A worker that fails where rank 0 did not (or the reverse), dies, or does not answer within the
  timeout breaks the engine: ParallelError, now and at every later call.
"""

from __future__ import annotations

import functools
import random
import weakref
from collections.abc import Iterator

from turnkv.errors import InvalidRequestError, ParallelError
from turnkv.parallel.worker_loop import ENGINE


def mirrored(method):
    """Decorate a method of the engine (which has `parallel`) or of an object with `llm` and `id`."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        leader = _leader_of(self)
        if leader is None or leader.depth:
            return method(self, *args, **kwargs)
        return _run(leader, self, method, args, kwargs)

    return call


def gather(obj, fn, *args) -> list:
    """fn(obj, *args) on every rank, each on its own copy of `obj` (the engine, or an object of it):
    the results in rank order, pickled back from the workers. fn is a module-level function (it is
    pickled by name) that reads, or that runs the model alike on every
    rank and leaves the engine as it found it (a benchmark's timed prefills). One device: [fn(obj, *args)]."""
    leader = _leader_of(obj)
    if leader is None:
        return [fn(obj, *args)]
    if leader.streaming or leader.depth:
        raise InvalidRequestError("a tensor-parallel engine runs one call at a time")
    leader.send(("apply", ENGINE if getattr(obj, "llm", None) is None else obj.id, fn, args))
    try:
        results = [fn(obj, *args)]
    finally:
        answers = leader.answers()  # read even when rank 0's call raised: the next call's answers come next
    for rank, (kind, detail) in sorted(answers.items()):
        if kind != "done":
            leader.fail(f"rank {rank} raised {detail[0]}: {detail[1]} in {fn.__name__}")
        results.append(detail)
    return results


def lockstep(engine, fn, args: tuple, here, signature=lambda result: None):
    """Run a step of a caller that drives the engine itself (the server's worker thread) on every rank:
    fn(worker's engine, *args) on each worker and here() on rank 0, at once; returns here()'s result.
    fn is a module-level function (pickled by name, with `args`) that makes on a worker the changes
    here() makes on rank 0, and returns signature(here()'s result) as a worker saw it: rank 0 checks
    that every worker's equals its own. Calls here() makes run on rank 0 alone (mirrored ones
    included). Where rank 0 raised, every worker must have raised an exception of the same type; then
    rank 0's is raised and the engine goes on. Any other disagreement, a dead worker or one silent past
    the timeout: ParallelError, and the engine is broken. One device: here()."""
    leader = _leader_of(engine)
    if leader is None:
        return here()
    if leader.streaming or leader.depth:
        raise InvalidRequestError("a tensor-parallel engine runs one call at a time")
    leader.send(("apply", ENGINE, fn, args))
    leader.depth += 1
    try:
        result = here()
    except BaseException as e:
        leader.depth -= 1
        _settle(leader, e)
        raise
    leader.depth -= 1
    expected = signature(result)
    for rank, (kind, detail) in sorted(leader.answers().items()):
        if kind != "done":
            leader.fail(f"rank {rank} raised {detail[0]}: {detail[1]} in {fn.__name__} where rank 0 did not")
        if detail != expected:
            leader.fail(f"rank {rank} ended {fn.__name__} with {detail!r} where rank 0 ended it with {expected!r}")
    return result


def _leader_of(obj):
    engine = getattr(obj, "llm", obj)
    membership = getattr(engine, "parallel", None)
    return None if membership is None else membership.leader


def _run(leader, obj, method, args, kwargs):
    if leader.streaming:
        raise InvalidRequestError("a tensor-parallel engine runs one call at a time: read the open stream to its "
                                  "end (or close it) first")
    target = ENGINE if getattr(obj, "llm", None) is None else obj.id
    if kwargs.get("temperature") and kwargs.get("seed") is None:
        kwargs = {**kwargs, "seed": random.getrandbits(63)}
    leader.send(("call", target, method.__name__, args, kwargs))
    leader.depth += 1
    try:
        result = method(obj, *args, **kwargs)
    except BaseException as e:
        leader.depth -= 1
        _settle(leader, e)
        raise
    if isinstance(result, Iterator):
        leader.depth -= 1
        return _Followed(leader, result)
    leader.depth -= 1
    _settle(leader, None)
    if getattr(result, "id", None) is not None and _leader_of(result) is leader:
        leader.post(("adopt", result.id))
        weakref.finalize(result, leader.post, ("drop", result.id))
    return result


class _Followed:
    """Rank 0's side of a mirrored iterator: yields its items; the workers run theirs to the end, and so
    does this one when closed (or collected) early, started or not. Open, it holds the engine."""

    def __init__(self, leader, inner: Iterator):
        self.leader, self.inner, self.done = leader, inner, False
        leader.streaming = True

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        self.leader.depth += 1
        try:
            return next(self.inner)
        except StopIteration:
            self._end(None)
            raise
        except BaseException as e:
            self._end(e)
            raise
        finally:
            self.leader.depth -= 1

    def close(self) -> None:
        """Run the rest of the iterator on rank 0 and wait for the workers."""
        if self.done:
            return
        self.leader.depth += 1
        error = None
        try:
            for _ in self.inner:
                pass
        except BaseException as e:
            error = e
        finally:
            self.leader.depth -= 1
        self._end(error)
        if error is not None:
            raise error

    def __del__(self):
        if not self.done:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nowhere to raise it; the engine is marked broken if it is
                pass

    def _end(self, error: BaseException | None) -> None:
        self.done = True
        self.leader.streaming = False
        _settle(self.leader, error)


def _settle(leader, error: BaseException | None) -> None:
    """Wait for the workers' answers to the call rank 0 just ran (which raised `error`, or None) and
    check that they agree: ParallelError where they do not."""
    try:
        answers = leader.answers()
    except ParallelError as broken:
        raise broken from error
    for rank, (kind, detail) in sorted(answers.items()):
        if kind == "raised" and (error is None or detail[0] != type(error).__name__):
            leader.fail(f"rank {rank} raised {detail[0]}: {detail[1]}" +
                        ("" if error is None else f" where rank 0 raised {type(error).__name__}: {error}"))
        if kind == "done" and error is not None:
            leader.fail(f"rank 0 raised {type(error).__name__}: {error} where rank {rank} did not")
