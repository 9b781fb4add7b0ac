"""Decode selections replay from the graphed decode at N=2 (its host path on CPU: tests/parallel/graphed.py)
wherever every rank has a plan, the ranks agreeing on it before each selecting step, whatever variant each
rank's plan replays; where one rank has none, every rank takes the eager step. Either way N=2 gives N=1's
tokens (and kept positions)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from tests.parallel import graphed
from tests.parallel.conftest import three_turns
from turnkv.parallel.kept import kept
from turnkv.parallel.mirror import gather

RECIPES = [
    ("prefill=streaming_heads(pattern=random,ratio=0.5,sink=4,local=16,prefill_local=16)"
     " decode=lserve(budget=32,physical_page=16,logical_page=16)"),
    "quest decode=quest(budget=32,dense_layers=0)",
    "loopserve-d decode=loopserve(budget=16,warmup=2,interval=4)",
]
IDS = ["lserve-streaming", "quest", "loopserve-d"]
STEPS = NEW - 1  # decode steps per turn: the first token comes from the prefill


@pytest.fixture
def engines(tp_engines):
    """(N=1 eager, N=2 with the graphed decode on every rank)."""
    single, pair = tp_engines
    gather(pair, graphed.install, 4)
    try:
        yield single, pair
    finally:
        gather(pair, graphed.remove)


def counts(planned: int, graphed: int, eager: int) -> dict[str, int]:
    return {"planned": planned, "graphed": graphed, "eager": eager}


def since(llm, before: list[dict[str, int]]) -> list[dict[str, int]]:
    """Each rank's counts of the selecting steps' paths since `before` (gather(llm, graphed.paths))."""
    return [{k: n - was[k] for k, n in now.items()} for was, now in zip(before, gather(llm, graphed.paths))]


def play(llm, recipe: str, refused_turn: int | None = None):
    """Three turns: (token ids of each reply, kept positions after the last, per turn each rank's counts of
    the selecting steps' paths). refused_turn: the turn during which rank 1 finds no plan."""
    conv = llm.conversation(system=SYSTEM, recipe=recipe)
    tokens, paths = [], []
    try:
        for turn, message in enumerate(MESSAGES[:3]):
            gather(llm, graphed.refuse_plans, 1, turn == refused_turn)
            before = gather(llm, graphed.paths)
            tokens.append(conv.send(message, max_new_tokens=NEW, ignore_eos=True).token_ids)
            paths.append(since(llm, before))
        return tokens, kept(conv), paths
    finally:
        gather(llm, graphed.refuse_plans, 1, False)
        conv.close()


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_selecting_steps_replay_on_every_rank(engines, recipe):
    single, pair = engines
    tokens, positions, paths = play(pair, recipe)
    assert (tokens, positions) == three_turns(single, recipe)
    assert paths == [[counts(STEPS, STEPS, 0)] * 2] * 3
    variants = gather(pair, graphed.variants)  # the selection's own graphs ran (LoopServe: past its warm-up)
    assert variants[0] == variants[1] and variants[0].keys() & {"select", "rescore"}


def test_the_ranks_replay_different_variants(engines, tmp_path):
    """Rank 0's KV head streams in every layer, rank 1's selects: rank 0 replays its dense variant, rank 1
    its select and reuse variants, in the same steps."""
    from turnkv.methods.lserve.pattern import HeadPattern

    pattern = tmp_path / "pattern.json"
    HeadPattern(np.array([[True, False], [True, False]])).save_json(pattern)
    recipe = (f"lserve prefill=streaming_heads(pattern={pattern},sink=4,local=16,prefill_local=16) "
              "decode=lserve(budget=32,physical_page=16,logical_page=16)")
    single, pair = engines
    tokens, positions, paths = play(pair, recipe)
    assert (tokens, positions) == three_turns(single, recipe)
    assert paths == [[counts(STEPS, STEPS, 0)] * 2] * 3
    dense, selecting = gather(pair, graphed.variants)
    assert dense == {"dense": 3 * STEPS} and selecting.keys() == {"select", "reuse"}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_rank_without_a_plan_takes_every_rank_to_the_eager_step(engines, recipe):
    """Rank 1 finds no plan during the second turn: rank 0 drops the plans it made, both ranks step eagerly,
    and the third turn replays again."""
    single, pair = engines
    tokens, positions, paths = play(pair, recipe, refused_turn=1)
    assert (tokens, positions) == three_turns(single, recipe)
    replayed = [counts(STEPS, STEPS, 0)] * 2
    assert paths[0] == paths[2] == replayed
    assert paths[1] == [counts(STEPS, 0, STEPS), counts(0, 0, STEPS)]


@pytest.mark.parametrize("refused", [False, True], ids=["replayed", "refused"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_batch_in_a_padded_bucket(engines, recipe, refused):
    """Three prompts of different lengths decode as one batch, in the graphs' bucket of 4 (the all-reduces of
    4 rows, against 3 in the eager step): replayed on both ranks, or, where rank 1 finds no plan, eager on
    both."""
    single, pair = engines
    prompts = [list(range(5, 85)), list(range(100, 140)), list(range(300, 361))]
    options = {"recipe": recipe, "max_new_tokens": 6, "ignore_eos": True}
    expected = [r.token_ids for r in single.generate(prompts, **options)]
    gather(pair, graphed.refuse_plans, 1, refused)
    try:
        before = gather(pair, graphed.paths)
        assert [r.token_ids for r in pair.generate(prompts, **options)] == expected
        paths = since(pair, before)
    finally:
        gather(pair, graphed.refuse_plans, 1, False)
    steps = 5
    if refused:
        assert paths == [counts(steps, 0, steps), counts(0, 0, steps)]
    else:
        assert paths == [counts(steps, steps, 0)] * 2
