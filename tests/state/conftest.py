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


def packing_engine(model_dir, **options):
    """The model with fixed restore costs instead of a calibration: every pack of a module splits alike."""
    import turnkv
    from turnkv.state.schedule import CostModel

    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB", **options)
    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    return llm
