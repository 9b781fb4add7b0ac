"""The graphed decode's host path on CPU in each rank's engine, through turnkv.parallel.mirror.gather (which
pickles these functions by name): GraphedDecode installed as on CUDA (the same buffers and host planning, the
replayed steps run eagerly), with counts of the selecting steps' paths, and plans refused on one rank."""

from __future__ import annotations

from turnkv.engine import graph_selection
from turnkv.engine.cuda_graphs import GraphedDecode


def install(engine, max_batch: int) -> None:
    """Decode through GraphedDecode from now on, with count()'s counters."""
    runner = engine.runner
    runner.graphs = GraphedDecode(engine.model, engine.pool, engine.max_model_len, max_batch=max_batch)
    count(engine)


def count(engine) -> None:
    """Count, per selecting step of the engine's GraphedDecode (CUDA's own, or install()'s), the plans this
    rank made (`planned`), the steps replayed with a plan (`graphed`) and the eager steps (`eager`), and
    the steps of each selection graph's variant."""
    runner = engine.runner
    engine.paths = {"planned": 0, "graphed": 0, "eager": 0}
    engine.variants = {}
    engine.refusing = False
    chooser = graph_selection.for_graphs(runner.graphs)
    plan, after_eager, graphed_decode = chooser.plan, chooser.after_eager, runner._graphed_decode

    def planning(seqs, selectors):
        made = None if engine.refusing else plan(seqs, selectors)
        engine.paths["planned"] += made is not None
        for handler in chooser.handlers.values():
            if handler is not None and "replay" not in vars(handler):
                handler.replay = counting_variants(handler.replay)
        return made

    def counting_variants(replay):
        def counted(key, *args):
            engine.variants[key[1]] = engine.variants.get(key[1], 0) + 1
            return replay(key, *args)
        return counted

    def eager(seqs, selectors):
        engine.paths["eager"] += 1
        return after_eager(seqs, selectors)

    def replayed(seqs, tokens, windows, made=None):
        engine.paths["graphed"] += made is not None
        return graphed_decode(seqs, tokens, windows, made)

    chooser.plan, chooser.after_eager, runner._graphed_decode = planning, eager, replayed


def remove(engine) -> None:
    """Back to the eager decode the engine had on CPU."""
    runner = engine.runner
    runner.graphs.close()
    runner.graphs = None
    del runner._graphed_decode


def paths(engine) -> dict[str, int]:
    return dict(engine.paths)


def variants(engine) -> dict[str, int]:
    """The selection graphs' steps run since install(), per variant."""
    return dict(engine.variants)


def refuse_plans(engine, rank: int, refusing: bool) -> None:
    """On `rank` alone, every selecting step from now on finds no plan (refusing), or plans again."""
    if engine.parallel.rank == rank:
        engine.refusing = refusing
