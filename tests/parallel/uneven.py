"""Pools that fill unevenly across the ranks, through turnkv.parallel.mirror.gather (which pickles these
functions by name): one rank holds pages aside, as if its KV heads kept more tokens than the others';
and a count of the reservations on which a rank's own answer was not the agreed one."""

from __future__ import annotations

import numpy as np


def free_pages(engine) -> list[int]:
    """The rank's free pages per layer."""
    return [engine.pool.free_pages(layer) for layer in range(engine.pool.num_layers)]


def hold_pages(engine, rank: int, leave: int | None) -> list[int]:
    """On `rank`, give back the pages held aside before, then (leave not None) hold aside pages until
    `leave` stay free in every layer; the other ranks change nothing. Returns free_pages()."""
    pool = engine.pool
    if engine.parallel.rank == rank:
        held = getattr(engine, "held_aside", None)
        if held is not None:
            pool.release(*held)
            engine.held_aside = None
        if leave is not None:
            counts = np.array([max(0, pool.free_pages(layer) - leave) for layer in range(pool.num_layers)])
            engine.held_aside = (np.repeat(np.arange(pool.num_layers), counts), pool.allocate_flat(counts))
    return free_pages(engine)


def location(conv) -> str:
    """Where the rank holds the conversation's KV: "gpu" (the pool), "cpu" or "disk"."""
    return conv.location


def turns(conv) -> int:
    return len(conv.turns)


def watch_agreements(engine) -> None:
    """From now on, count the agreements (PagePool.agree) whose outcome differs from what this rank sent:
    the reservations another rank's pool decided (or the cache drops it asked for)."""
    agree = engine.pool.agree
    engine.overruled = 0

    def counted(values):
        out = agree(values)
        engine.overruled += list(out) != [int(v) for v in values]
        return out

    engine.pool.agree = counted


def overruled(engine) -> int:
    return engine.overruled
