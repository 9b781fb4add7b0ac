"""Krul and MiniCache on the real SmolLM2-135M: the stated fidelity (teacher-forced greedy agreement
with the resident run on the returning turn) and the storage they save; `load` stays exact."""

from __future__ import annotations

import pytest

from turnkv.bench.metrics import greedy_agreement, mean_kl

MESSAGES = ["My name is Ada and I keep bees in Lyon. Remember the number 7261. How do bees make honey?",
            "What was the number, and what is my name?"]


@pytest.fixture(scope="module")
def smol(embedded_model):
    import turnkv

    return turnkv.LLM(device="cpu")  # the thresholds below were measured in fp32 on CPU


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


# What each lossy restore measured on the returning turn's 16 greedy tokens (fp32, on CPU), and the
# margins the test allows: one token of agreement (1/16), and a quarter more KL. SmolLM2's adjacent
# layers are nearly orthogonal, so merging them is lossy; a change that loses more than the margin
# fails here. recipe: (greedy agreement, mean KL in nats, stored / full KV). Krul's agreement is the
# lower of two machines' values: 0.375 on the 2-core CI machine, 0.25 on the GPU lane's host CPU
# (KL 0.84 on both): fp32 sums in another order flip near-tied greedy tokens after a lossy restore.
MEASURED = {"state=krul(fallback=never)": (0.25, 0.84, 0.767), "state=minicache": (0.1875, 1.57, 0.796)}
AGREEMENT_MARGIN, KL_MARGIN = 1 / 16, 1.25


@pytest.mark.slow
def test_smollm2_restore_fidelity(smol, record_property):
    ref, _, _ = replay(smol, "state=gpu")
    tokens = [t for t, _ in ref]
    load, stored, full = replay(smol, "state=load", tokens)
    assert greedy_agreement(load[1][1], tokens[1]) == 1.0 and stored == full
    for recipe, (agreement, kl, kept) in MEASURED.items():
        got, stored, full = replay(smol, recipe, tokens)
        measured = (greedy_agreement(got[1][1], tokens[1]), mean_kl(ref[1][1], got[1][1]), stored / full)
        record_property(recipe, measured)
        assert measured[0] >= agreement - AGREEMENT_MARGIN, (recipe, measured)
        assert measured[1] <= kl * KL_MARGIN, (recipe, measured)
        assert measured[2] <= kept + 0.01, (recipe, measured)
