"""One-shot generation, batched decode across sequences of different lengths, and sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turnkv.engine.detokenizer import IncrementalDetokenizer
from turnkv.engine.sampling import SamplingParams, sample
from turnkv.errors import ContextLengthError, InvalidRequestError

PROMPTS = ["The sea", "Once upon a time in a land far away there lived", "1, 2, 3,"]


def test_batched_decode_equals_each_prompt_alone(chat_llm):
    together = chat_llm.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    alone = [chat_llm.generate(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS]
    assert len({len(chat_llm.encode(p)) for p in PROMPTS}) == 3  # different lengths in one batch
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert chat_llm.pool.bytes_in_use() == chat_llm.prefix_cache_bytes()  # one-shot sequences give their pages back


def test_token_id_prompts_and_errors(chat_llm):
    ids = chat_llm.encode("Hello there")
    assert chat_llm.generate(ids, max_new_tokens=4).token_ids == chat_llm.generate("Hello there", max_new_tokens=4).token_ids
    V = chat_llm.config.vocab_size
    for bad in ([10**9], [V], [-1], [1, 2**70], [3, 1.5], [4, "x"], [[1, 2], [3]]):
        with pytest.raises(InvalidRequestError, match="list of ids"):
            chat_llm.encode(bad)
    with pytest.raises(InvalidRequestError):
        chat_llm.generate([10**9])
    assert chat_llm.encode([0, V - 1]) == [0, V - 1]
    with pytest.raises(InvalidRequestError):
        chat_llm.generate("")
    with pytest.raises(ContextLengthError):
        chat_llm.generate(list(range(100, 100 + chat_llm.max_model_len)))


def test_text_that_encodes_outside_the_models_vocabulary_is_refused(chat_llm, monkeypatch):
    """A random-weight shape can borrow a tokenizer with more tokens than its vocabulary: text that
    encodes to such an id gets a clear error (not an out-of-range embedding lookup), and a
    conversation loses nothing."""
    conv = chat_llm.conversation()
    first = conv.send("Hello there", max_new_tokens=3)
    top = max(chat_llm.encode("Hello there, a zebra question"))
    kept = list(conv.tokens)
    # The highest id is now one past the vocabulary.
    monkeypatch.setattr(chat_llm, "config", dataclasses.replace(chat_llm.config, vocab_size=top))
    with pytest.raises(InvalidRequestError, match=f"token id {top}, outside"):
        chat_llm.generate("Hello there, a zebra question", max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="outside"):
        conv.send("Hello there, a zebra question", max_new_tokens=2)
    assert conv.tokens == kept and len(conv.turns) == 1 and first.token_ids
    monkeypatch.undo()
    assert len(conv.send("and then?", max_new_tokens=2).token_ids) == 2
    assert len(conv.turns) == 2
    conv.close()


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(chat_llm):
    kw = dict(max_new_tokens=12, temperature=1.5, ignore_eos=True)
    a = chat_llm.generate("The sea", seed=1, **kw).token_ids
    assert chat_llm.generate("The sea", seed=1, **kw).token_ids == a
    assert any(chat_llm.generate("The sea", seed=s, **kw).token_ids != a for s in (2, 3, 4))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert all(int(sample(logits, params, g)) == int(logits.argmax()) for _ in range(20))


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 2.8, -5.0, -5.0, -6.0])
    g = torch.Generator().manual_seed(0)
    assert {int(sample(logits, SamplingParams(temperature=5.0, top_k=3), g)) for _ in range(300)} == {0, 1, 2}
    probs = logits.softmax(-1)  # top_p=0.5 keeps the tokens needed to reach half the mass: 0 and 1
    assert probs[0] < 0.5 < probs[0] + probs[1]
    assert {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g)) for _ in range(300)} == {0, 1}


def test_detokenizer_waits_for_whole_characters_and_holds_back_stop_prefixes(smol_tokenizer):
    text = "Weather: ☀️ then 🌧️, 温度 20°C. END here"
    ids = smol_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smol_tokenizer, stop=["END"])
    pieces = []
    for t in ids:
        pieces.append(detok.push(t))
        assert "\ufffd" not in pieces[-1]
        if detok.stopped:
            break
    pieces.append(detok.flush())
    assert detok.stopped and "".join(pieces) == text[: text.index("END")]
