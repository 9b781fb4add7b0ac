"""The model the state tests share: a tiny random llama with six layers (so layers can pair and
recompute lengths can shrink with depth) and SmolLM2's tokenizer and chat template."""

from __future__ import annotations

import pytest

from conftest import save_tiny

LAYERS = 6


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("tiny-chat-6")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer, num_hidden_layers=LAYERS)
    return path
