"""The user-facing engine: a model, its tokenizer, a KV page pool, conversations and one-shot generation."""

from __future__ import annotations

import re

import numpy as np
import torch

from turnkv.engine import decode_loop
from turnkv.engine.conversation import Conversation
from turnkv.engine.generation import Generation, Reply
from turnkv.engine.runner import ModelRunner
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from turnkv.kv.pool import PagePool
from turnkv.kv.quant import kv_dtype_name
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe
from turnkv.model.load import DEFAULT_MODEL, embedded_model_path, load_model
from turnkv.model.tokenizer import load_folder_tokenizer, load_gguf_tokenizer
from turnkv.paths import user_path
from turnkv.state.manager import StateManager

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise InvalidRequestError(f"cannot read {size!r} as a size; write e.g. 2GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def _optional_bytes(size: int | str | None) -> int | None:
    return None if size is None else parse_bytes(size)


class LLM:
    """Load a model and serve conversations on it.

    model: None (the embedded SmolLM2-135M-Instruct), a GGUF file, a Hugging Face safetensors
    folder, or a shape name for random weights (e.g. "llama-3.1-8b").
    kv_memory: bytes (or "2GiB") for the KV page pool; by default room for four full contexts on
    CPU, and most of the free memory on a GPU; or a function (config, dtype) -> bytes.
    cuda_graphs: replay decode steps from CUDA graphs (on CUDA).
    state_cpu_memory / state_disk_dir / state_disk_memory / state_gpu_memory: the tiers conversation
    state moves to between turns (turnkv.state): a host pool (pinned with CUDA, allocated on first
    use), a directory (kept across restarts), and optional caps on disk and resident bytes.
    kv_dtype: how the pool stores K/V: None or "none" (the model's dtype), "int8" or "fp8" (e4m3),
    quantized per token and head with an fp32 scale (turnkv/kv/quant.py). A recipe's kv_dtype key
    sets it too; conversations whose recipe asks for another one are refused.
    """

    def __init__(self, model: str | None = None, dtype=None, device: str | None = None,
                 kv_memory: int | str | None = None, page_size: int = 16, max_model_len: int | None = None,
                 tokenizer: str | None = None, prefill_chunk: int | None = None, seed: int = 0, recipe=None,
                 cuda_graphs: bool = True, state_cpu_memory: int | str = "1GiB", state_disk_dir: str | None = None,
                 state_disk_memory: int | str | None = None, state_gpu_memory: int | str | None = None,
                 kv_dtype: str | torch.dtype | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loaded = load_model(model, dtype, self.device, seed)
        self.model, self.name, self.source = loaded.model, loaded.name, loaded.source
        self.config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = loaded.tokenizer
        if tokenizer is not None:
            self.tokenizer = _load_tokenizer(tokenizer)
        elif self.tokenizer is None and loaded.source == "random":
            # Random-weight shapes borrow the embedded model's tokenizer, when it is installed, so the
            # text APIs work too; without it they take token ids.
            try:
                self.tokenizer = _load_tokenizer(None)
            except ModelLoadError:
                self.tokenizer = None
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        default_recipe = self._parse_recipe(recipe)
        self.kv_dtype = self._choose_kv_dtype(kv_dtype, default_recipe)
        self.pool = PagePool.for_budget(self.config, self._kv_budget(kv_memory), page_size, self.dtype, self.device,
                                        self.kv_dtype)
        if prefill_chunk is None:
            # Bigger chunks on a GPU: each chunk re-reads the kept history, and flash attention runs
            # well below its peak rate on short query blocks (benchmarks/BENCHMARKS.md, prefill).
            prefill_chunk = 32768 if self.device.type == "cuda" else 4096
        self.runner = ModelRunner(self.model, self.pool, prefill_chunk, self.max_model_len, cuda_graphs)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos
        self.vocab_limit = len(self.tokenizer) if self.tokenizer is not None else None
        self.recipe = self.resolve_recipe(default_recipe)
        self.state = StateManager(self, parse_bytes(state_cpu_memory), state_disk_dir,
                                  _optional_bytes(state_disk_memory), _optional_bytes(state_gpu_memory))

    def resolve_recipe(self, recipe):
        """A Recipe, a recipe string or file path, or None for this engine's default (full cache).
        A recipe whose kv_dtype differs from this engine's pool is refused (InvalidRequestError)."""
        recipe = self._parse_recipe(recipe)
        if recipe.kv_dtype is not None and recipe.kv_dtype != self.pool.kv_dtype_name:
            raise InvalidRequestError(
                f"the recipe asks for kv_dtype={recipe.kv_dtype}, but this engine's KV pool holds "
                f"kv_dtype={self.pool.kv_dtype_name} ({str(self.pool.kv_dtype).removeprefix('torch.')}); the pool's "
                f"storage is chosen when the engine is built: LLM(kv_dtype=...) or LLM(recipe=...)")
        return recipe

    def _parse_recipe(self, recipe):
        if recipe is None:
            return getattr(self, "recipe", None) or Recipe()
        if isinstance(recipe, Recipe):
            return recipe
        if isinstance(recipe, str) and recipe.endswith((".json", ".yaml", ".yml")):
            return Recipe.from_file(recipe)
        if isinstance(recipe, str):
            return Recipe.parse(recipe)
        raise InvalidRequestError(f"a recipe is a Recipe, a string or a file path, not {type(recipe).__name__}")

    @staticmethod
    def _choose_kv_dtype(kv_dtype, recipe) -> str:
        """The pool's storage: the kv_dtype argument, else the default recipe's, else the model dtype."""
        asked = kv_dtype_name(kv_dtype) if kv_dtype is not None else None
        if asked is not None and recipe.kv_dtype is not None and asked != recipe.kv_dtype:
            raise InvalidRequestError(f"kv_dtype={asked} and the recipe's kv_dtype={recipe.kv_dtype} disagree")
        return asked or recipe.kv_dtype or "none"

    def _kv_budget(self, kv_memory) -> int:
        if callable(kv_memory):  # sized from the loaded model: kv_memory(config, dtype) -> bytes
            return int(kv_memory(self.config, self.dtype))
        if kv_memory is not None:
            return parse_bytes(kv_memory)
        per_token = self.kv_bytes_per_token()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(per_token * 1024, int(free * 0.85) - (2 << 30))
        return min(4 * self.max_model_len * per_token, 8 << 30)

    def kv_bytes_per_token(self) -> int:
        """K/V bytes (scales included) one token takes in the pool, over every layer and KV head."""
        c = self.config
        return c.num_layers * c.num_kv_heads * PagePool.token_head_bytes(c.head_dim, self.dtype, self.kv_dtype)

    # ---- building blocks the conversation uses ------------------------------------------------
    def sampling_params(self, **kwargs) -> SamplingParams:
        try:
            return SamplingParams(**kwargs)
        except TypeError as e:
            raise InvalidRequestError(f"unknown sampling option: {e}") from None

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.name} has no tokenizer; pass tokenizer=... or token ids")
        return self.tokenizer

    def new_generation(self, seq: SequenceKV, params: SamplingParams, **options) -> Generation:
        return Generation(seq, params, self.tokenizer, self.eos_ids, self.vocab_limit, self.max_model_len,
                          self.device, **options)

    def token_tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.int64, device=self.device)

    # ---- public API -----------------------------------------------------------------------------
    def conversation(self, system: str | None = None, recipe=None) -> Conversation:
        return Conversation(self, system, recipe)

    def resume(self, conversation_id: str) -> Conversation:
        """A conversation stored in the state tiers (the disk tier survives restarts), by its id."""
        return Conversation.from_record(self, conversation_id, self.state.record(conversation_id))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return self.require_tokenizer().encode(prompt)
        # One numpy pass, not a Python check per id: strings, floats
        # and ints too big for int64 give a dtype that is not an integer kind.
        try:
            ids = np.asarray(prompt) if isinstance(prompt, (list, tuple)) else np.empty(0)
        except ValueError:  # ragged nesting
            ids = np.empty(0)
        if ids.ndim != 1 or not ids.size or ids.dtype.kind not in "iub" or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InvalidRequestError(f"a token-id prompt must be a non-empty list of ids in [0, {self.config.vocab_size})")
        return list(prompt)

    def generate(self, prompts: str | list[int] | list[str | list[int]], recipe=None, **sampling) -> Reply | list[Reply]:
        """One-shot completion of raw prompts (text or token ids), decoded together as a batch.
        With an evicting recipe, each prompt is compressed after its prefill (question-aware)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequestError("no prompts given")
        params = self.sampling_params(**sampling)
        recipe = self.resolve_recipe(recipe)
        encoded = [self.encode(p) for p in batch]
        for ids in encoded:
            if len(ids) + 1 > self.max_model_len:
                raise ContextLengthError(f"a prompt of {len(ids)} tokens does not fit the context of {self.max_model_len}")
        convs = [Conversation(self, None, recipe) for _ in batch]  # containers for the KV and recipe state
        try:
            replies = self.run_prompts(convs, encoded, params)
        finally:
            for conv in convs:
                conv.close()
        return replies[0] if single else replies

    def run_prompts(self, convs: list[Conversation], prompts: list[list[int]],
                    params: SamplingParams) -> list[Reply]:
        """One turn per (empty conversation, token-id prompt), decoded together to the end: the raw
        prompt is the turn (no chat template, no history kept); the KV and the recipe's state stay in
        the conversations for the caller to read, then close."""
        turns = [TurnRun(conv, TurnInput(0, ids, segment_end=len(ids)), self.new_generation(conv.kv, params)).begin()
                 for conv, ids in zip(convs, prompts)]
        for turn in turns:
            turn.take(turn.prefill())
        for _ in decode_loop.decode(self, turns):
            pass
        return [turn.finish() for turn in turns]

    def info(self) -> dict:
        c = self.config
        return {
            "model": self.name, "source": self.source, "architecture": c.architecture,
            "parameters": c.num_parameters(), "layers": c.num_layers, "hidden_size": c.hidden_size,
            "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "vocab_size": c.vocab_size, "max_model_len": self.max_model_len, "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device), "kv_dtype": self.pool.kv_dtype_name, "kv_bytes_per_token": self.kv_bytes_per_token(),
            "kv_pool_bytes": self.pool.capacity_bytes(), "page_size": self.pool.page_size,
            "kv_pool_tokens": self.pool.num_pages * self.pool.page_size // c.num_kv_heads,
        }


def _load_tokenizer(spec: str | None):
    if spec is None or spec == DEFAULT_MODEL:
        return load_gguf_tokenizer(embedded_model_path())
    path = user_path(spec)
    return load_folder_tokenizer(path) if path.is_dir() else load_gguf_tokenizer(path)
