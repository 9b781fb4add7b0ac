"""Shared fixtures: tiny random checkpoints saved in the Hugging Face format, and the SmolLM2 tokenizer."""

from __future__ import annotations

import gc
import os

# One intra-op thread per test process unless TURNKV_TEST_THREADS says otherwise. Several threads
# meet at a barrier after every parallel op; on a busy machine one of them is often descheduled and
# the others wait for it, op after op, and the small models' ops are short enough for those waits to
# dominate. Set before torch is imported, so processes the tests start (the CLI, a server, benchmark
# workers) inherit it.
THREADS = int(os.environ.get("TURNKV_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("MKL_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402  (after the thread settings above)
import torch  # noqa: E402

torch.set_num_threads(THREADS)

# Tests never reach a model hub: everything they load is built here or shipped by a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in its interpreter; the flag is read when triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from tests.triton_interpreter import install

        install()  # the interpreter's bitwise reductions (tl.sort's and tl.topk's) in numpy

# Tests that take tens of seconds to minutes each (the embedded model's, the tensor-parallel engines').
# Run first: the last tests of a run then are short ones, and under `make test`'s `--dist worksteal` a
# worker that is done takes them from the other instead of waiting while it finishes a long one.
LONG_FIRST = ("tests/parallel/",)


def pytest_collection_modifyitems(config, items):
    """Move the long tests (marked slow, or under LONG_FIRST) to the front, in their collected order."""
    root = str(config.rootpath) + os.sep

    def long(item) -> bool:
        path = str(item.path).removeprefix(root).replace(os.sep, "/")
        return item.get_closest_marker("slow") is not None or path.startswith(LONG_FIRST)

    items[:] = [item for item in items if long(item)] + [item for item in items if not long(item)]


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """The CLI freezes the heap for the engine it keeps (turnkv.heap); within the test process that
    would keep every later test's dropped engines from being collected, so undo it after each test."""
    yield
    gc.unfreeze()


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def save_tiny(path, family: str, vocab_size: int = 320, tokenizer=None, **overrides):
    """Build a random HF model of `family` with a tiny config, save it to `path`, return the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=vocab_size, **{**TINY, **overrides})
    model = model_cls(config).eval()
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def two_turn_logits(path, family: str, device: str, **overrides):
    """A tiny random `family` model saved to `path`, prefilled through the engine's runner in chunks of
    8 over two turns (18 tokens as 8, 8, 2, then 12 as 8, 4), with every logit kept -> (turnkv's
    logits [30, V], transformers' logits of the 30 tokens at once, the model's config), both on the CPU."""
    from turnkv.engine.runner import ModelRunner
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV
    from turnkv.model.load import load_model

    hf = save_tiny(path, family, **overrides)
    model = load_model(str(path), dtype="float32").model.to(device)
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.to(device)(ids[None].to(device)).logits[0].cpu()
    c = model.config
    pool = PagePool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32, device)
    runner = ModelRunner(model, pool, prefill_chunk=8, cuda_graphs=False)
    seq = SequenceKV(pool)
    first = runner.prefill(seq, ids[:18].tolist(), all_logits=True)
    second = runner.prefill(seq, ids[18:].tolist(), all_logits=True)  # the later turn
    return torch.cat([first, second]).cpu(), ref, c


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded SmolLM2 GGUF file; a machine without it skips the test and names what is missing."""
    from turnkv.errors import ModelLoadError
    from turnkv.model.load import embedded_model_path

    try:
        return embedded_model_path()
    except ModelLoadError as error:
        pytest.skip(f"needs the embedded model: {error}")


@pytest.fixture(scope="session")
def smol_tokenizer(embedded_model):
    from turnkv.model.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(embedded_model)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, smol_tokenizer):
    """A tiny random llama with SmolLM2's tokenizer and chat template, for conversation tests."""
    path = tmp_path_factory.mktemp("tiny-chat")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer)
    return path


@pytest.fixture(scope="session")
def chat_llm(chat_model_dir):
    import turnkv

    return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")


@pytest.fixture
def prompt_hook_events(monkeypatch):
    """The order of first tokens sampled and after-prompt hooks, across the engine (a test appends
    its own events, such as decode forwards), for tests/engine/test_prompt_hook_order.py and
    tests/serve/test_first_token_order.py."""
    from turnkv.engine.generation import Generation
    from turnkv.methods.recipe import Recipe

    out = []
    hook, accept = Recipe.after_prompt, Generation.accept

    def spy_hook(self, kv, *args):
        out.append("hook")
        return hook(self, kv, *args)

    def spy_accept(self, token, *args, **kwargs):
        if not self.token_ids:
            out.append("first token")
        return accept(self, token, *args, **kwargs)

    monkeypatch.setattr(Recipe, "after_prompt", spy_hook)
    monkeypatch.setattr(Generation, "accept", spy_accept)
    return out
