"""A worker rank's command loop: run rank 0's calls on this rank's engine, in rank 0's order.

Commands (tuples on the worker's queue, from turnkv/parallel/mirror.py):
- ("call", target, method name, args, kwargs): call the method of the object named `target` (ENGINE,
  or an id given by "adopt"); an iterator it returns is run to its end. Answers (rank, "done", None)
  or (rank, "raised", (exception type name, message)).
- ("adopt", id): the last call's result is the object rank 0 knows by `id` (a conversation: its `id`
  is set to it, so that every rank stores its shard under one key). No answer.
- ("drop", id): rank 0 let go of that object. No answer.
- ("apply", target, fn, args): answers (rank, "done", fn(target object, *args)), or "raised".
- None: stop.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
from collections.abc import Iterator

ENGINE = "engine"


def serve(rank: int, engine, commands, acks) -> None:
    objects = {ENGINE: engine}
    last = None
    parent = multiprocessing.parent_process()
    while True:
        try:
            command = commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # rank 0 is gone: nobody will send the next command
            continue
        if command is None:
            return
        if isinstance(command, bytes):  # Leader.send pickles the command itself
            command = pickle.loads(command)
        kind = command[0]
        if kind == "adopt":
            objects[command[1]] = last
            last.id = command[1]
        elif kind == "drop":
            objects.pop(command[1], None)
        elif kind == "apply":
            _, target, fn, args = command
            try:
                acks.put((rank, "done", fn(objects[target], *args)))
            except Exception as e:  # noqa: BLE001 - rank 0 raises it
                acks.put((rank, "raised", (type(e).__name__, str(e))))
        elif kind == "call":
            _, target, name, args, kwargs = command
            last = None
            try:
                result = getattr(objects[target], name)(*args, **kwargs)
                if isinstance(result, Iterator):
                    for _ in result:
                        pass
                else:
                    last = result
            except Exception as e:  # noqa: BLE001 - rank 0 compares it with its own outcome
                acks.put((rank, "raised", (type(e).__name__, str(e))))
                continue
            acks.put((rank, "done", None))
        else:
            raise ValueError(f"unknown command {kind!r}")
