"""Krul's layer pairing under N=2 is computed from every rank's query heads: each rank pairs the layers
as N=1 does, on a model with layers enough to choose (6), and the replies and kept positions are N=1's.
Where no pairing could make the plan win, every rank skips the estimator alike."""

from __future__ import annotations

import pytest

from tests.conftest import save_tiny
from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from tests.parallel.conftest import engine_pair
from tests.parallel.probes import krul_pairs
from turnkv.parallel.kept import kept
from turnkv.parallel.mirror import gather


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("tiny-chat-six-layers")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer, num_hidden_layers=6)
    yield from engine_pair(path, "32MiB", "16MiB")


# fallback=never: the estimator always runs (on the tiny model the plan's fixed cost alone loses to `load`,
# so with fallback=auto it never would: the last case). The dense case stores its pairs all loaded and
# retains no row (each rank would retain the farthest rows of its own heads, not N=1's).
@pytest.mark.parametrize("recipe", ["state=krul(ir_threshold=0.0,fallback=never,max_retained=0)",
                                    "snapkv keep_ratio=0.5 state=krul(ir_threshold=0.0,fallback=never)",
                                    "snapkv keep_ratio=0.5 state=krul(ir_threshold=0.0)"])
def test_pairs_are_chosen_from_every_head(six_layers, recipe):
    runs = []
    for llm in six_layers:
        conv = llm.conversation(system=SYSTEM, recipe=recipe)
        tokens, pairs = [], []
        for message in MESSAGES[:3]:
            tokens.append(conv.send(message, max_new_tokens=NEW, ignore_eos=True).token_ids)
            if len(tokens) < 3:
                assert conv.offload("cpu") == "cpu"
                pairs.append(gather(conv, krul_pairs))
        runs.append((tokens, pairs, kept(conv)))
        conv.close()
    (tokens_1, pairs_1, kept_1), (tokens_2, pairs_2, kept_2) = runs
    assert tokens_2 == tokens_1 and kept_2 == kept_1
    if "fallback=never" not in recipe:  # no rank ran the estimator
        assert pairs_1 == [[None]] * 2 and pairs_2 == [[None, None]] * 2
        return
    assert all(p for (p,) in pairs_1)  # pairs were chosen at each store
    assert pairs_2 == [[p, p] for (p,) in pairs_1]  # by both ranks, as N=1
