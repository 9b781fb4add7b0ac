"""Sanity of the quality suite on the embedded SmolLM2: a random-eviction control scores clearly
below SnapKV on retrieval.

By construction: two-turn needle conversations on short documents, the second turn asking about a
fact of the first, the question at the end of its message. Eviction (schedule=prefill) compresses the
finished first turn, about 180 tokens, to 112 per KV head when the second prompt is prefilled. SnapKV's
observation window is the end of that prompt, the question, so it keeps the keys the question
attends to, the needle among them; random eviction keeps 112 random ones, so some of the needle's
digits are gone. Only the second turn is compared: the first is never compressed.
Greedy decoding and seeded instances make the outcome deterministic; the full cache answering is
asserted first, so the comparison cannot pass on a model that fails the task anyway.
"""

from __future__ import annotations

from statistics import mean

import pytest

from turnkv.bench.datasets.tasks import generate
from turnkv.bench.quality import QualityConfig, run_quality

BUDGET = 112


@pytest.fixture(scope="module")
def smol_llm(embedded_model):
    import turnkv

    return turnkv.LLM()  # the embedded SmolLM2-135M-Instruct, on CPU here


@pytest.mark.slow
def test_random_eviction_scores_clearly_below_snapkv_on_retrieval(smol_llm, tmp_path):
    instances = generate("needle_qa", n=16, seed=0, turns=2, context_tokens=120, difficulty=0,
                         tokenizer=smol_llm.tokenizer)
    # SnapKV with max pooling over 7 keys, Ada-KV's code's setting (the ada-snapkv preset's). The
    # authors' SnapKV default (average pooling over 5) measured 1 of 16 here, against 7 of 16 for this
    # setting and 9 of 16 for the full cache: averaging spreads a needle's weight over its neighbours.
    config = QualityConfig(recipes={"snapkv": f"evict=snapkv(kernel=7,pooling=max) budget={BUDGET}",
                                    "random": f"random budget={BUDGET}"},
                           positions=("end",), max_new_tokens=16, fidelity=False)
    records = run_quality(smol_llm, instances, config, tmp_path / "r.jsonl", progress=False)
    score = {name: mean(r["score"] for r in records if r["recipe"] == name and r["turn"] == 1)
             for name in ("full", "snapkv", "random")}
    # Full cache > SnapKV > random on this model and task; the bounds leave one or two of the 16
    # instances of slack each way around the scores it gives.
    assert score["full"] >= 0.4, score  # the model can do the task at all
    assert score["snapkv"] >= score["full"] - 0.25, score
    assert score["random"] <= score["snapkv"] - 0.125, score
