"""A mixed step (engine/mixed.py) is exact: decode tokens and a prefill slice carried by one forward
give the same greedy tokens as each request run alone, whatever the recipe asks of the step (an
observation window and compression at the prompt's end, a sparse prefill pattern and decode
selection)."""

from __future__ import annotations

import pytest
import torch

from turnkv.engine import decode_loop, mixed
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun

pytestmark = pytest.mark.slow

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
RECIPES = [None, "ada-snapkv keep_ratio=0.5", "lserve-random"]
MAX_NEW = 12


def _turn(llm, ids, recipe):
    conv = Conversation(llm, None, recipe)
    params = llm.turn_parts.sampling_params(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    return TurnRun(conv, TurnInput(0, ids, len(ids)), llm.turn_parts.new_generation(conv.kv, params)).begin()


def _alone(llm, ids, recipe) -> list[int]:
    turn = _turn(llm, ids, recipe)
    turn.take(turn.prefill())
    while not turn.done:
        for t, piece in decode_loop.step(llm, [turn]):
            pass
    tokens = list(turn.gen.token_ids)
    turn.conv.close()
    return tokens


def _mixed(llm, short: list[list[int]], long: list[int], recipe, slice_tokens: int) -> tuple[list[list[int]], int]:
    """The short prompts decode while the long one prefills in slices inside their steps; returns
    every request's tokens and how many forwards carried both."""
    runs = [_turn(llm, ids, recipe) for ids in short]
    for t in runs:
        t.take(t.prefill())
    late = _turn(llm, long, recipe)
    both = 0
    while not all(t.done for t in [*runs, late]):
        decoding = [t for t in runs if not t.done] + ([late] if late.gen.token_ids and not late.done else [])
        groups = decode_loop.batches(decoding)
        parts = [mixed.decode_part(g) for g in groups]
        if late.prefill_left:
            parts.append(mixed.slice_part(late, slice_tokens))
            both += bool(groups)
        logits = mixed.forward(llm.runner, parts)
        for group, rows in zip(groups, logits):
            for t, row in zip(group, rows):
                t.after_step(row)
        if late.prefill_left:
            last = late.chunk_prefilled(parts[-1].width, logits[-1][0])
            if last is not None:
                late.take(last)
    out = [list(t.gen.token_ids) for t in [*runs, late]]
    for t in [*runs, late]:
        t.conv.close()
    return out, both


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, embedded_model):
    import turnkv

    # fp32 on CUDA too: in bf16 a decode batch of two rounds differently from a batch of one, which moves
    # a greedy token of a compressing recipe with or without a prefill slice beside it.
    return turnkv.LLM(embedded_model, device=request.param, dtype="float32", kv_memory="256MiB")


@pytest.mark.parametrize("recipe", RECIPES)
def test_mixed_steps_match_requests_run_alone(llm, recipe):
    short = [llm.encode("The history of the Roman empire is long and varied. It began"),
             llm.encode("Write a poem about the sea and the sky, with rhymes that")]
    long = llm.encode(" ".join(["Paris is the capital of France, a large city with many museums."] * 24)
                      + " Question: what is the capital of France? Answer:")
    alone = [_alone(llm, ids, recipe) for ids in [*short, long]]
    together, both = _mixed(llm, short, long, recipe, slice_tokens=64)
    assert both >= 3  # the long prompt's slices rode along the decode steps
    assert together == alone
    assert all(len(tokens) == MAX_NEW for tokens in together)


def test_a_failed_mixed_step_leaves_every_sequence_as_it_was(llm, monkeypatch):
    short = _turn(llm, llm.encode("One two three four"), None)
    short.take(short.prefill())
    late = _turn(llm, llm.encode("five six seven eight nine ten"), None)
    before = (short.seq.next_position, late.seq.next_position)

    def fail(*args, **kwargs):  # the forward fails after every sequence reserved its slots
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.runner.model, "forward", fail)
    with pytest.raises(RuntimeError, match="injected"):
        mixed.forward(llm.runner, [mixed.decode_part([short]), mixed.slice_part(late, 4)])
    monkeypatch.undo()
    assert (short.seq.next_position, late.seq.next_position) == before
    short.conv.close()
    late.conv.close()
