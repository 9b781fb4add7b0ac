"""Synthetic multi-passkey retrieval text, generated in code (no data set download).

DuoAttention calibrates on 10 passkeys hidden in a haystack at depths 0.05-0.95 and trains on the
answer tokens, where the model must retrieve from far back: heads it needs there are retrieval
heads. Here the haystack is sentences built from a small word list, and the question at the end
asks for every passkey in order, followed by the answer (the keys) whose hidden states are compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORDS = ("the grass is green the sky is blue the sun is yellow here we go there and back again "
         "a river runs past an old mill while birds sing in tall trees and the wind moves slowly").split()


@dataclass
class PasskeySample:
    tokens: list[int]
    answer: list[int]  # indices into tokens of the answer tokens (the loss positions)


def _haystack(rng, num_words: int) -> str:
    return " ".join(rng.choice(WORDS, num_words)).capitalize() + "."


def passkey_text(rng: np.random.Generator, num_keys: int, key_digits: int, words: int) -> tuple[str, str]:
    """(context + question, answer) with `num_keys` passkeys spread at depths 0.05-0.95."""
    keys = ["".join(rng.choice(list("0123456789"), key_digits)) for _ in range(num_keys)]
    depths = np.sort(rng.uniform(0.05, 0.95, num_keys))
    cuts = np.concatenate([[0], (depths * words).astype(int), [words]])
    parts = []
    for n, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        parts.append(_haystack(rng, max(int(hi - lo), 1)))
        if n < num_keys:
            parts.append(f"The passkey number {n + 1} is {keys[n]}. Remember it.")
    question = " What are the passkeys? The passkeys are"
    return " ".join(parts) + question, " " + ", ".join(keys) + "."


def passkey_samples(tokenizer=None, num_samples: int = 4, num_tokens: int = 512, num_keys: int = 4,
                    key_digits: int = 8, vocab_size: int | None = None, seed: int = 0) -> list[PasskeySample]:
    """Samples of about `num_tokens` tokens. With a tokenizer: real text. Without one (tiny random
    models): random ids where each key is a random id span copied into the answer, the same structure."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_samples):
        if tokenizer is not None:
            words = max(num_tokens - num_keys * (key_digits + 12) - 30, 8)  # words are about one token
            context, answer = passkey_text(rng, num_keys, key_digits, words)
            ctx_ids = tokenizer.encode(context)
            ans_ids = tokenizer.encode(answer)
        else:
            if vocab_size is None:
                raise ValueError("passkey_samples needs a tokenizer or a vocab_size")
            keys = [rng.integers(3, vocab_size, key_digits).tolist() for _ in range(num_keys)]
            hay = rng.integers(3, vocab_size, max(num_tokens - 2 * num_keys * key_digits, 8)).tolist()
            cuts = np.sort(rng.integers(int(0.05 * len(hay)), int(0.95 * len(hay)) + 1, num_keys))
            ctx_ids, last = [], 0
            for cut, key in zip(cuts, keys):
                ctx_ids += hay[last:cut] + key
                last = cut
            ctx_ids += hay[last:]
            ans_ids = [t for key in keys for t in key]
        tokens = ctx_ids + ans_ids
        samples.append(PasskeySample(tokens, list(range(len(ctx_ids), len(tokens)))))
    return samples
