"""The user-facing engine: a model, its tokenizer, a KV page pool, conversations and one-shot generation."""

from __future__ import annotations

import numpy as np
import torch

from turnkv import gpu
from turnkv.attention import flash
from turnkv.engine import chat_template
from turnkv.engine.conversation import Conversation
from turnkv.engine.generation import Reply
from turnkv.engine.runner import ModelRunner
from turnkv.engine.turn_parts import TurnParts
from turnkv.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from turnkv.kv.pool import PagePool
from turnkv.kv.prefix_index import PrefixIndex
from turnkv.kv.quant import kv_dtype_name
from turnkv.methods.recipe import RECIPE_KEYS, Recipe
from turnkv.model.load import DEFAULT_MODEL, embedded_model_path, load_model, resolve_device, use_expandable_segments
from turnkv.model.parallel import shard_model
from turnkv.model.tokenizer import load_folder_tokenizer, load_gguf_tokenizer
from turnkv.parallel import launch
from turnkv.parallel.limits import check_recipe
from turnkv.parallel.mirror import mirrored
from turnkv.paths import user_path
from turnkv.sizes import parse_bytes
from turnkv.state.manager import StateManager


def _optional_bytes(size: int | str | None) -> int | None:
    return None if size is None else parse_bytes(size)


PREFIX_MODES = ("turns", "system", "off")


def prefix_mode(value) -> str:
    """The prefix index's mode for LLM(prefix_cache=value): one of PREFIX_MODES (True: "turns",
    False: "off"); InvalidRequestError for anything else."""
    if value is True or value is False:
        return "turns" if value else "off"
    if isinstance(value, str) and value in PREFIX_MODES:
        return value
    raise InvalidRequestError(f"prefix_cache must be one of {', '.join(map(repr, PREFIX_MODES))} (or True / False), "
                              f"not {value!r}")


class LLM:
    """Load a model and serve conversations on it.

    model: None (the embedded SmolLM2-135M-Instruct), a GGUF file, a Hugging Face safetensors
    folder, or a shape name for random weights (e.g. "llama-3.1-8b"). Paths expand ~ and $VARS.
    dtype: "float32", "bfloat16" or "float16" (default: float32 on CPU, bfloat16 on CUDA).
    device: "cpu", "cuda" or "cuda:N" (default: cuda when a GPU is usable); DeviceError when absent.
    kv_memory: bytes (or "2GiB") for the KV page pool; by default room for four full contexts on
    CPU, and most of the free memory on a GPU; or a function (config, dtype) -> bytes.
    page_size: tokens per KV page. max_model_len: the context limit (default: the model's).
    tokenizer: a folder with tokenizer.json or a GGUF file, for models that ship none.
    prefill_chunk: tokens per prefill slice (default: 4096 on CPU, 32768 on a GPU).
    seed: the seed of a shape name's random weights.
    recipe, **recipe_options: the default recipe of conversations and generate(), in any form
    Recipe.of takes (a preset or recipe string, a file, a mapping, a Recipe) with recipe keys as
    keywords: LLM(recipe="ada-snapkv", budget=64). Default: the full cache.
    cuda_graphs: replay decode steps from CUDA graphs (on CUDA).
    state_cpu_memory / state_disk_dir / state_disk_memory / state_gpu_memory: the tiers conversation
    state moves to between turns (turnkv.state): a host pool (pinned with CUDA, allocated on first
    use), a directory (kept across restarts), and optional caps on disk and resident bytes.
    kv_dtype: how the pool stores K/V: None or "none" (the model's dtype), "int8" or "fp8" (e4m3),
    quantized per token and head with an fp32 scale (turnkv/kv/quant.py). A recipe's kv_dtype key
    sets it too; conversations whose recipe asks for another one are refused.
    prefix_cache: what the prefix index keeps and shares with later conversations of the same recipe
    whose tokens begin the same way (turnkv/engine/prefix.py): "turns" (the default; True) the KV
    of system prompts and, under a recipe whose kept state depends on the token ids alone
    (Recipe.path_independent: full, lserve, ...), of every turn's end, which a conversation whose first
    request carries earlier turns takes instead of prefilling them; "system" system prompts only
    (replies bitwise the same as with no index); "off" (False) no index. A turn end's reply KV was
    written by decode steps, which a fresh prefill matches up to rounding (docs/serving.md).
    prefix_cache_memory: the index's cap (bytes or "1GiB"; default a quarter of the pool); when the
    pool runs short, index entries go first.
    """

    def __init__(self, model: str | None = None, dtype=None, device: str | None = None,
                 kv_memory: int | str | None = None, page_size: int = 16, max_model_len: int | None = None,
                 tokenizer: str | None = None, prefill_chunk: int | None = None, seed: int = 0, recipe=None,
                 cuda_graphs: bool = True, state_cpu_memory: int | str = "1GiB", state_disk_dir: str | None = None,
                 state_disk_memory: int | str | None = None, state_gpu_memory: int | str | None = None,
                 kv_dtype: str | torch.dtype | None = None, prefix_cache: bool | str = "turns",
                 prefix_cache_memory: int | str | None = None, tensor_parallel: int = 1, **recipe_options):
        # What a worker of a tensor-parallel engine builds its own rank's engine from.
        launch_args = {**{k: v for k, v in locals().items() if k not in ("self", "recipe_options")}, **recipe_options}
        unknown = sorted(set(recipe_options) - RECIPE_KEYS)
        if unknown:
            raise InvalidRequestError(f"LLM() got an unknown argument {unknown[0]!r}: neither an engine argument nor "
                                      f"a recipe option ({', '.join(sorted(RECIPE_KEYS))})")
        default_recipe = Recipe.of(recipe, **recipe_options)  # a bad recipe fails before the model loads
        self.prefix_mode = prefix_mode(prefix_cache)
        self.turn_parts = TurnParts(self)  # what Conversation, the server and the benchmarks build turns from
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            use_expandable_segments()
        self.kv_dtype = self._choose_kv_dtype(kv_dtype, default_recipe)

        def check_pool(config, dtype) -> None:  # a pool too small for one page per KV head fails before the load
            if kv_memory is not None:
                budget = self._kv_budget(kv_memory, config, dtype)
                PagePool.check_budget(config, budget, page_size, dtype, self.kv_dtype)

        # Tensor parallelism (turnkv/parallel/launch.py): rank 0 (this process) spawns the workers, each
        # building this engine over its shard of the model; every rank's pool holds its own KV heads.
        self.parallel = launch.start(tensor_parallel, self.device, type(self), launch_args)
        if self.parallel is not None:
            self.device = self.parallel.device
            state_disk_dir = self.parallel.disk_dir(state_disk_dir)
        loaded = load_model(model, dtype, self.device, seed, check_config=check_pool)
        if self.parallel is not None:
            loaded.model = shard_model(loaded.model, self.parallel.shard(loaded.model.config))
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
        budget = self._kv_budget(kv_memory, self.config, self.dtype)
        if self.parallel is not None:  # pools of one size on every rank: the smallest free memory decides
            budget = self.parallel.smallest(budget)
        self.pool = PagePool.for_budget(self.config, budget, page_size, self.dtype, self.device, self.kv_dtype)
        self.pool.shard = getattr(self.model, "shard", None)
        if self.parallel is not None:  # every reservation's outcome is agreed across ranks (PagePool.room)
            self.pool.agree = self.parallel.agree
        # FlashAttention-4's kernels compile here (once per machine with its disk cache), not inside the
        # first long prompt (attention/flash.py); a no-op where it is not used.
        flash.warm_up(self.device, self.dtype, self.config.num_heads, self.config.num_kv_heads, self.config.head_dim,
                      page_size)
        self.prefix_index = None
        if self.prefix_mode != "off":
            cap = _optional_bytes(prefix_cache_memory)
            self.prefix_index = PrefixIndex(self.pool, self.pool.capacity_bytes() // 4 if cap is None else cap)
            self.pool.cache = self.prefix_index  # its entries go first when an allocation lacks room
        if prefill_chunk is None:
            # Bigger chunks on a GPU: each chunk re-reads the kept history, and flash attention runs
            # well below its peak rate on short query blocks (benchmarks/prefill/README.md).
            prefill_chunk = 32768 if self.device.type == "cuda" else 4096
        self.runner = ModelRunner(self.model, self.pool, prefill_chunk, self.max_model_len, cuda_graphs)
        if self.parallel is not None and self.parallel.leader is not None:
            self.parallel.leader.closers.insert(0, self.runner.drop_graphs)  # before the group is aborted
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos
        # The text the chat template writes after a reply: a reply's end token renders as the start of it.
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        self.reply_end = chat_template.reply_end(self.tokenizer) if has_template else ""
        self.vocab_limit = len(self.tokenizer) if self.tokenizer is not None else None
        self.recipe = self.resolve_recipe(default_recipe)
        self.state = StateManager(self, parse_bytes(state_cpu_memory), state_disk_dir,
                                  _optional_bytes(state_disk_memory), _optional_bytes(state_gpu_memory))
        if self.parallel is not None and self.parallel.leader is not None:
            self.parallel.leader.wait_ready()
            self.parallel.built()

    def resolve_recipe(self, recipe=None, **options) -> Recipe:
        """The Recipe that `recipe` and `options` name (see Recipe.of), over this engine's default
        recipe when `recipe` is None. InvalidRequestError for a bad recipe, or one whose kv_dtype
        differs from this engine's pool."""
        recipe = Recipe.of(self.recipe if recipe is None and hasattr(self, "recipe") else recipe, **options)
        if recipe.kv_dtype is not None and recipe.kv_dtype != self.pool.kv_dtype_name:
            raise InvalidRequestError(
                f"the recipe asks for kv_dtype={recipe.kv_dtype}, but this engine's KV pool holds "
                f"kv_dtype={self.pool.kv_dtype_name} ({str(self.pool.kv_dtype).removeprefix('torch.')}); the pool's "
                f"storage is chosen when the engine is built: LLM(kv_dtype=...) or LLM(recipe=...)")
        check_recipe(recipe, getattr(self.model, "shard", None))
        return recipe

    @staticmethod
    def _choose_kv_dtype(kv_dtype, recipe) -> str:
        """The pool's storage: the kv_dtype argument, else the default recipe's, else the model dtype."""
        asked = kv_dtype_name(kv_dtype) if kv_dtype is not None else None
        if asked is not None and recipe.kv_dtype is not None and asked != recipe.kv_dtype:
            raise InvalidRequestError(f"kv_dtype={asked} and the recipe's kv_dtype={recipe.kv_dtype} disagree")
        return asked or recipe.kv_dtype or "none"

    def _kv_budget(self, kv_memory, config, dtype) -> int:
        if callable(kv_memory):  # sized from the model: kv_memory(config, dtype) -> bytes
            return int(kv_memory(config, dtype))
        if kv_memory is not None:
            return parse_bytes(kv_memory)
        per_token = self.kv_bytes_per_token()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(per_token * 1024, int(free * 0.85) - (2 << 30))
        return min(4 * self.max_model_len * per_token, 8 << 30)

    def prefix_cache_bytes(self) -> int:
        """Bytes of the pages the prefix index holds (pages that conversations hold too included)."""
        return self.prefix_index.bytes() if self.prefix_index is not None else 0

    def kv_bytes_per_token(self) -> int:
        """K/V bytes (scales included) one token takes in the pool, over every layer and KV head."""
        c = self.config
        return c.num_layers * c.num_kv_heads * PagePool.token_head_bytes(c.head_dim, self.dtype, self.kv_dtype)

    # ---- what the engine's turn drivers use (the rest is in turn_parts) -----------------------------
    def _token_tensor(self, tokens: list[int]) -> torch.Tensor:
        """Token ids as an int64 tensor on the engine's device, without waiting for the device (a
        pageable copy would hold the host until the work queued after the last step ran)."""
        return gpu.upload(torch.tensor(tokens, dtype=torch.int64), self.device)

    # ---- public API -----------------------------------------------------------------------------
    @mirrored
    def conversation(self, system: str | None = None, recipe=None, history: list[dict] | None = None,
                     **recipe_options) -> Conversation:
        """A new conversation that keeps its KV between turns (send/stream a message per turn).

        system: the system prompt, or None.
        history: earlier turns to continue from, [{"role": "user" | "assistant", "content": str}, ...];
        the first send prefills them with its message, taking the longest part the prefix index
        holds (another conversation's turn end, under a recipe that shares turn ends).
        recipe, **recipe_options: how its KV is compressed and stored, in any form Recipe.of takes,
        over this engine's default recipe when `recipe` is None:
        conversation(recipe="ada-snapkv", budget=64), conversation(recipe="snapkv", keep_ratio=0.25,
        turns="flowkv"), conversation(budget=128) (when the engine's default recipe evicts).
        InvalidRequestError for an unknown preset, key or value, as in the string form."""
        return Conversation(self, system, self.resolve_recipe(recipe, **recipe_options), history)

    @mirrored
    def resume(self, conversation_id: str) -> Conversation:
        """The conversation stored in the state tiers under `conversation_id` (Conversation.id; the
        disk tier, state_disk_dir, survives restarts), with its history; its KV comes back at its
        next turn. InvalidRequestError when no conversation is stored under that id."""
        return Conversation.from_record(self, conversation_id, self.state.record(conversation_id))

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (the tokenizer's, no chat template), or a token-id list checked
        against the vocabulary. InvalidRequestError for an empty prompt or ids out of range."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return self.turn_parts.check_ids(self.turn_parts.require_tokenizer().encode(prompt))
        # One numpy pass, not a Python check per id: strings, floats
        # and ints too big for int64 give a dtype that is not an integer kind.
        try:
            ids = np.asarray(prompt) if isinstance(prompt, (list, tuple)) else np.empty(0)
        except ValueError:  # ragged nesting
            ids = np.empty(0)
        if ids.ndim != 1 or not ids.size or ids.dtype.kind not in "iub" or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InvalidRequestError(f"a token-id prompt must be a non-empty list of ids in [0, {self.config.vocab_size})")
        return list(prompt)

    @mirrored
    def generate(self, prompts: str | list[int] | list[str | list[int]], recipe=None, **options) -> Reply | list[Reply]:
        """One-shot completion of raw prompts (text or token ids; no chat template), decoded together
        as a batch. Returns a Reply, or a list of them for a list of prompts.

        recipe and recipe keys among `options` (budget=..., keep_ratio=..., ...): as conversation()
        takes them; with an evicting recipe each prompt is compressed after its prefill
        (question-aware). The other `options` are sampling parameters (SamplingParams):
        max_new_tokens=256, temperature=0.0 (greedy), top_p=1.0, top_k=0 (no cut), seed=None,
        stop=[] (strings that end the reply), ignore_eos=False. ContextLengthError when a prompt and
        max_new_tokens (when given) do not fit the context; without it, a reply stops at the context's end."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequestError("no prompts given")
        recipe_options = {k: options.pop(k) for k in list(options) if k in RECIPE_KEYS}
        params = self.turn_parts.sampling_params(**options)
        recipe = self.resolve_recipe(recipe, **recipe_options)
        encoded = [self.encode(p) for p in batch]
        for ids in encoded:
            if len(ids) + 1 > self.max_model_len:
                raise ContextLengthError(f"a prompt of {len(ids)} tokens does not fit the context of {self.max_model_len}")
            if "max_new_tokens" in options:  # as /v1/completions refuses a max_tokens the context has no room for
                self.turn_parts.check_room(len(ids), params.max_new_tokens)
        convs = [Conversation(self, None, recipe) for _ in batch]  # containers for the KV and recipe state
        try:
            replies = self.turn_parts.run_prompts(convs, encoded, params)
        finally:
            for conv in convs:
                conv.close()
        return replies[0] if single else replies

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's worker processes (it is unusable afterwards); nothing on one
        device. Also done at exit and when the engine is collected."""
        if self.parallel is not None and self.parallel.leader is not None:
            self.parallel.leader.shutdown()

    def info(self) -> dict:
        """The model's shape, dtype and device, and the KV pool's storage, size and bytes per token."""
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
    """The tokenizer of `spec`: a folder with tokenizer files, a GGUF file, or None / the default
    model's name (the embedded model's). ModelLoadError when there is none to load."""
    if spec is None or spec == DEFAULT_MODEL:
        return load_gguf_tokenizer(embedded_model_path())
    path = user_path(spec)
    if not path.exists():
        raise ModelLoadError(f"tokenizer {spec!r} not found{'' if str(path) == spec else f' (looked for {path})'}: "
                             f"give a folder with tokenizer.json or tokenizer_config.json, or a GGUF file")
    tokenizer = load_folder_tokenizer(path) if path.is_dir() else load_gguf_tokenizer(path)
    if tokenizer is None:
        raise ModelLoadError(f"{path} holds no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)")
    return tokenizer
