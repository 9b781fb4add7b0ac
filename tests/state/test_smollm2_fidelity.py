"""Krul and MiniCache on the real SmolLM2-135M: the stated fidelity (teacher-forced greedy agreement
with the resident run on the returning turn) and the storage they save; `load` stays exact."""

from __future__ import annotations

import pytest

from turnkv.bench.metrics import greedy_agreement, mean_kl

MESSAGES = ["My name is Ada and I keep bees in Lyon. Remember the number 7261. How do bees make honey?",
            "What was the number, and what is my name?"]


@pytest.fixture(scope="module")
def smol():
    import turnkv

    return turnkv.LLM()


def replay(llm, recipe, reference=None):
    conv = llm.conversation(system="You are a helpful assistant.", recipe=recipe)
    out = []
    for i, m in enumerate(MESSAGES):
        reply = conv.send(m, max_new_tokens=16, force=reference[i] if reference else None, logprobs=True)
        out.append((reply.token_ids, reply.logprobs))
    stored = llm.state.stored_bytes(conv) if conv.location == "cpu" else None
    full = llm.config.kv_bytes_per_token(4) * (len(conv.tokens) - 1)
    conv.close()
    return out, stored, full


@pytest.mark.slow
def test_smollm2_restore_fidelity(smol):
    ref, _, _ = replay(smol, "state=gpu")
    tokens = [t for t, _ in ref]
    load, stored, full = replay(smol, "state=load", tokens)
    assert greedy_agreement(load[1][1], tokens[1]) == 1.0 and stored == full
    # Stated fidelity (SmolLM2's adjacent layers are nearly orthogonal, so merging is lossy;
    # benchmarks/results/state_fidelity.md): at least 15% of the returning turn's greedy tokens, a
    # mean KL under 4 nats, at most 85% of the full KV.
    for recipe in ("state=krul(fallback=never)", "state=minicache"):
        got, stored, full = replay(smol, recipe, tokens)
        assert greedy_agreement(got[1][1], tokens[1]) >= 0.15
        assert mean_kl(ref[1][1], got[1][1]) < 4.0
        assert stored <= 0.85 * full
