"""How a tensor-parallel engine fails: bad requests fail alike on every rank and the engine goes on; a
rank that dies or hangs makes rank 0 raise ParallelError (it does not hang), and shutdown ends every
worker."""

from __future__ import annotations

import time

import pytest

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from tests.parallel import faults
from tests.parallel.conftest import TIMEOUT_S
from turnkv.errors import InvalidRequestError, ModelLoadError, ParallelError
from turnkv.parallel.kept import kept
from turnkv.parallel.mirror import gather

PROMPT = list(range(5, 30))


def test_a_bad_request_fails_alike_and_the_engine_goes_on(tp_engines):
    single, pair = tp_engines
    with pytest.raises(InvalidRequestError, match="no prompts"):
        pair.generate([])
    conv = pair.conversation(system=SYSTEM)
    with pytest.raises(InvalidRequestError, match="context"):
        conv.send("hello", max_new_tokens=10**6)
    with pytest.raises(InvalidRequestError, match="sampling option"):
        conv.send("hello", temprature=0.5)
    conv.close()
    assert pair.generate(PROMPT, max_new_tokens=4).token_ids == single.generate(PROMPT, max_new_tokens=4).token_ids


def test_one_call_at_a_time_and_an_early_close_finishes_the_turn(tp_engines):
    """While a stream is open another call is refused; a stream closed early runs its turn to the end
    on every rank, so the ranks stay in step: the next turn is N=1's after two whole turns."""
    single, pair = tp_engines
    ref = single.conversation(system=SYSTEM)
    expected = [ref.send(m, max_new_tokens=NEW, ignore_eos=True).token_ids for m in MESSAGES[:2]]
    ref.close()

    conv = pair.conversation(system=SYSTEM)
    stream = conv.stream(MESSAGES[0], max_new_tokens=NEW, ignore_eos=True)
    next(stream)
    with pytest.raises(InvalidRequestError, match="one call at a time"):
        pair.generate(PROMPT, max_new_tokens=2)
    stream.close()
    assert conv.turns[-1].reply.token_ids == expected[0]
    assert conv.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids == expected[1]
    assert len(kept(conv)) == pair.config.num_layers * 2  # both ranks answer, each with its KV head
    conv.close()


@pytest.mark.parametrize("fault, timeout, error", [
    (faults.exit_at_next_forward, "60", "rank 1 exited"),
    (faults.hang_at_next_forward, "5", "did not answer within 5 s"),
])
def test_a_failed_rank_raises_on_rank_0(chat_model_dir, monkeypatch, fault, timeout, error):
    import turnkv

    monkeypatch.setenv("TURNKV_TP_TIMEOUT", timeout)
    monkeypatch.setenv("TURNKV_TP_BUILD_TIMEOUT", TIMEOUT_S)  # the engine builds within it on a loaded 2-core machine
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", tensor_parallel=2)
    processes = llm.parallel.leader.processes
    try:
        gather(llm, fault)
        start = time.monotonic()
        with pytest.raises(ParallelError, match=error):
            llm.generate(PROMPT, max_new_tokens=2)
        assert time.monotonic() - start < 2 * float(timeout) + 10
        with pytest.raises(ParallelError, match="broken"):
            llm.generate(PROMPT, max_new_tokens=2)
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 20
    assert not any(p.is_alive() for p in processes)


def test_arguments_that_cannot_reach_the_workers(chat_model_dir):
    import turnkv

    with pytest.raises(ParallelError, match="pickled"):
        turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=lambda config, dtype: 1 << 24, tensor_parallel=2)


@pytest.mark.parametrize("size, error, message", [(0, ParallelError, "integer >= 1"), (3, ModelLoadError, "query heads")])
def test_a_size_the_model_cannot_take(chat_model_dir, size, error, message):
    """Checked before any worker starts (0), or by every rank when it shards the model (3 ranks of 4
    query heads): rank 0 raises, naming the cause."""
    import turnkv

    with pytest.raises(error, match=message):
        turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB", tensor_parallel=size)


def test_arguments_of_a_call_that_cannot_be_sent(tp_engines):
    """A Recipe object holding what cannot be pickled (streaming heads' weak references) is refused
    before anything is sent; its string form works."""
    from turnkv.methods.recipe import Recipe

    single, pair = tp_engines
    recipe = Recipe.of("lserve-random")
    with pytest.raises(InvalidRequestError, match="pickled"):
        pair.conversation(recipe=recipe)
    assert pair.generate(PROMPT, recipe=str(recipe), max_new_tokens=3).token_ids == \
        single.generate(PROMPT, recipe=recipe, max_new_tokens=3).token_ids


def test_the_server_refuses_a_tier_hook_of_its_own_on_a_tensor_parallel_engine(tp_engines):
    """Every rank keeps idle conversations in its own state tiers (serve/engine_ops.py): a custom hook
    would run on rank 0 alone."""
    from turnkv.serve.app import create_app

    _, pair = tp_engines
    with pytest.raises(InvalidRequestError, match="tensor-parallel"):
        create_app(pair, tiers=object())


def test_the_build_timeout_defaults_to_the_collective_timeout(monkeypatch):
    from turnkv.parallel.launch import build_timeout, collective_timeout

    monkeypatch.delenv("TURNKV_TP_TIMEOUT", raising=False)
    monkeypatch.delenv("TURNKV_TP_BUILD_TIMEOUT", raising=False)
    assert collective_timeout() == build_timeout() == 600
    monkeypatch.setenv("TURNKV_TP_TIMEOUT", "7")
    assert build_timeout() == 7
    monkeypatch.setenv("TURNKV_TP_BUILD_TIMEOUT", "90")
    assert (collective_timeout(), build_timeout()) == (7, 90)
    monkeypatch.setenv("TURNKV_TP_BUILD_TIMEOUT", "soon")
    with pytest.raises(ParallelError, match="TURNKV_TP_BUILD_TIMEOUT='soon' is not a number"):
        build_timeout()
