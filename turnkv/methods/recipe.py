"""A recipe picks one component per axis (turnkv.methods.protocols): the prefill pattern; eviction,
which is a scorer + allocator + budget + schedule (`evict`) and a turn policy (`turns`); the decode
selection; and the state between turns. The engine calls it at fixed points of a turn and never the
other way round.

Recipes are dataclasses, or strings such as
    "evict=snapkv(window=32)+adakv(alpha=0.2) budget=1024 turns=flowkv"
    "ada-snapkv budget=256"                      (a preset, then overrides)
    "snapkv budget=256 kv_dtype=int8"            (K/V stored as int8; see below)
or JSON/YAML files with the same keys.

`kv_dtype` (int8, fp8 or none) is not an axis but a property of the engine's page pool, which holds
every conversation's K/V in one storage dtype: an engine built with a recipe that names it
(`LLM(recipe=...)`) builds its pool in that dtype, and a conversation whose recipe asks for another
one than its engine's pool holds is refused (InvalidRequestError). Unset, a recipe runs on any pool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import yaml

from turnkv.errors import InvalidRequestError
from turnkv.kv.quant import kv_dtype_name
from turnkv.methods.decode.all import AllDecode
from turnkv.methods.evict.eviction import Eviction, check_options
from turnkv.methods.prefill.dense import DensePrefill
from turnkv.methods.prefill.pattern_hook import PatternHook, summarise
from turnkv.methods.protocols import Decode, DecodeSelection, Prefill, StateStrategy, StaticSparsity, Turns
from turnkv.methods.registry import build
from turnkv.methods.step_context import StepContext
from turnkv.methods.terms import format_term, option_string, parse_term, parse_value, split_top_level
from turnkv.methods.turns.recompress import RecompressTurns
from turnkv.methods.window import QueryMoments, QueryWindow
from turnkv.model.parallel import Shard
from turnkv.paths import user_path

EVICTION_KEYS = {"budget", "keep_ratio", "compression_ratio", "schedule", "every"}
# Every key a recipe string, file or keyword argument may set.
RECIPE_KEYS = frozenset({"prefill", "evict", "turns", "decode", "state", "answer", "kv_dtype"} | EVICTION_KEYS)
DEFAULT_BUDGET = 1024
DEFAULT_EVERY = 64


@dataclass
class MethodState:
    """What a recipe keeps per conversation."""

    window: QueryWindow | None
    frozen_upto: int = 0  # FlowKV: positions below this were compressed once and are final
    since_compression: int = 0  # decode schedule: tokens generated since the last compression
    log: list[dict] = field(default_factory=list)
    decode: DecodeSelection | None = None  # the decode selection's state, None when decode reads everything
    pattern_stats: list[dict] = field(default_factory=list)  # the running turn's per-layer prefill entries
    stats: list[dict] = field(default_factory=list)  # per turn: what the prefill pattern / decode selection did
    accumulate: bool = False  # the scorer adds up attention mass (H2O)
    sparse_prefill: Prefill | None = None  # the recipe's prefill pattern component, or None (dense prefill)

    @property
    def context(self) -> StepContext:
        """What this conversation's forward steps do beyond dense attention (the runner's argument)."""
        pattern = None if self.sparse_prefill is None else PatternHook(self.sparse_prefill, self.pattern_stats)
        return StepContext(self.window, self.accumulate, pattern, self.decode)


def _resident() -> StateStrategy:
    # The state strategies live in turnkv.state, above this layer; they are registered by the time
    # a recipe is made (importing turnkv imports the engine, which imports them).
    return build("state", "gpu")


@dataclass
class Recipe:
    """One component per axis; `evict` and `turns` together are the eviction axis (no eviction: evict
    is None, and the turn policy has nothing to do)."""

    prefill: Prefill = field(default_factory=DensePrefill)
    evict: Eviction | None = None
    turns: Turns = field(default_factory=RecompressTurns)
    decode: Decode = field(default_factory=AllDecode)
    state: StateStrategy = field(default_factory=_resident)
    # What becomes of the previous reply's KV at the next turn: "keep" it as decoded (cheaper), or
    # "reprefill" it: drop it and prefill the reply again with the new message, so that it goes
    # through the prefill pattern like the rest of the new block (the paper's faithful reading).
    answer: str = "keep"
    # The KV storage dtype the recipe needs ("int8", "fp8", "none" = the compute dtype), or None: any.
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.kv_dtype is not None:
            self.kv_dtype = kv_dtype_name(self.kv_dtype)
        if self.answer not in ("keep", "reprefill"):
            raise InvalidRequestError(f"answer must be 'keep' or 'reprefill', not {self.answer!r}")
        if self.evict is not None and self.evict.schedule in ("decode", "prompt") and self.turns.name == "flowkv":
            raise InvalidRequestError("flowkv keeps the running turn whole; use schedule=prefill or turn_end with it")
        if self.accumulates_attention and (self.sparse_prefill or self.selects_decode):
            raise InvalidRequestError(f"{self.evict.scorer.name} accumulates the attention of every key; it cannot "
                                      f"run with prefill={self.prefill.name} or decode={self.decode.name}")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Recipe:
        """Parse "preset key=value ..."; see the module docstring."""
        tokens = split_top_level(text.strip())
        if not tokens:
            return cls()
        recipe, overrides = cls(), {}
        for token in tokens:
            if "=" not in token.split("(")[0]:
                recipe = preset(token)
                continue
            key, value = token.split("=", 1)
            overrides[key.strip()] = value.strip()
        return recipe.with_overrides(overrides)

    @classmethod
    def of(cls, recipe=None, **options) -> Recipe:
        """A recipe from any form it is written in, with keyword overrides.

        recipe: None (the full cache: nothing compressed), a Recipe, a preset name or recipe string
        ("ada-snapkv budget=256"), a .json/.yaml/.yml file path, or a mapping with a file's keys.
        options: recipe keys as keywords, applied over `recipe` exactly as the string form's key=value
        would be, with the same validation: budget=64, keep_ratio=0.25, compression_ratio=0.75,
        schedule="decode", every=32, evict="snapkv(window=16)+adakv", turns="flowkv",
        prefill="a_shape(local=512)", decode="quest", state="krul", answer="reprefill", kv_dtype="int8".
        A component may also be a mapping ({"name": "a_shape", "local": 512}; an eviction block names
        its "scorer"). InvalidRequestError names the first problem."""
        if recipe is None:
            base = cls()
        elif isinstance(recipe, Recipe):
            base = recipe
        elif isinstance(recipe, dict):
            base = cls.from_dict(recipe)
        elif isinstance(recipe, (str, Path)) and str(recipe).endswith((".json", ".yaml", ".yml")):
            base = cls.from_file(recipe)
        elif isinstance(recipe, str):
            base = cls.parse(recipe)
        else:
            raise InvalidRequestError(f"a recipe is a Recipe, a string, a file path or a mapping, "
                                      f"not {type(recipe).__name__}")
        unknown = sorted(set(options) - RECIPE_KEYS)
        if unknown:
            raise InvalidRequestError(f"unknown recipe option {unknown[0]!r}; the options are "
                                      f"{', '.join(sorted(RECIPE_KEYS))}")
        return base.with_overrides({k: option_string(v) for k, v in options.items()}) if options else base

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        path = user_path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise InvalidRequestError(f"cannot read the recipe file {path}: {e}") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise InvalidRequestError(f"{path} is not valid YAML: {e}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError(f"{path} must hold a mapping of axis -> component")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        base = preset(data["preset"]) if "preset" in data else cls()
        overrides = {k: option_string(v) for k, v in data.items() if k != "preset"}
        return base.with_overrides(overrides)

    def with_overrides(self, overrides: dict[str, str]) -> Recipe:
        recipe = self
        evict_params = {k: parse_value(overrides.pop(k)) for k in list(overrides) if k in EVICTION_KEYS}
        for key, spec in overrides.items():
            if key == "evict":
                recipe = replace(recipe, evict=_parse_eviction(spec) if spec not in ("none", "full") else None)
            elif key in ("prefill", "turns", "decode", "state"):  # a field named as its registry kind
                name, params = parse_term(spec)
                recipe = replace(recipe, **{key: build(key, name, params)})
            elif key == "answer":
                recipe = replace(recipe, answer=spec)
            elif key == "kv_dtype":
                recipe = replace(recipe, kv_dtype=kv_dtype_name(spec))
            else:
                raise InvalidRequestError(
                    f"unknown recipe key {key!r}; use prefill, evict, turns, decode, state, answer, kv_dtype, or "
                    f"{', '.join(sorted(EVICTION_KEYS))}"
                )
        if evict_params:
            try:
                check_options(evict_params)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            if recipe.evict is None:
                raise InvalidRequestError(
                    f"{', '.join(evict_params)} sets how much an eviction method keeps, and this recipe evicts nothing: "
                    f"name one with evict=... or start from a preset that evicts (snapkv, ada-snapkv, h2o, "
                    f"streaming-llm, ...; `turnkv methods --presets` lists them)")
            recipe = replace(recipe, evict=_with_eviction_params(recipe.evict, evict_params))
        return recipe

    def with_named_files(self, named: dict[str, str]) -> Recipe:
        """This recipe with every file-valued parameter (a component's `file_params`) resolved through
        `named` (name -> path, chosen by whoever runs the engine). A value that is neither a built-in
        (such as pattern=random) nor one of those names raises InvalidRequestError without touching
        the filesystem: a recipe from an untrusted client reads only the files its operator named."""
        changes = {}
        for axis in ("prefill", "turns", "decode", "state"):
            component = _named_files(getattr(self, axis), named)
            if component is not getattr(self, axis):
                changes[axis] = component
        if self.evict is not None:
            scorer, allocator = _named_files(self.evict.scorer, named), _named_files(self.evict.allocator, named)
            if scorer is not self.evict.scorer or allocator is not self.evict.allocator:
                changes["evict"] = replace(self.evict, scorer=scorer, allocator=allocator)
        return replace(self, **changes) if changes else self

    def __str__(self) -> str:
        parts = [f"prefill={format_term(self.prefill)}"]
        if self.evict is not None:
            e = self.evict
            amount = f"budget={e.budget}" if e.budget is not None else f"keep_ratio={e.keep_ratio}"
            parts.append(f"evict={format_term(e.scorer)}+{format_term(e.allocator)} {amount} schedule={e.schedule}"
                         + (f" every={e.every}" if e.schedule == "decode" or e.every != DEFAULT_EVERY else ""))
        else:
            parts.append("evict=none")
        parts += [f"turns={format_term(self.turns)}", f"decode={format_term(self.decode)}",
                  f"state={format_term(self.state)}"]
        if self.answer != "keep":
            parts.append(f"answer={self.answer}")
        if self.kv_dtype is not None:
            parts.append(f"kv_dtype={self.kv_dtype}")
        return " ".join(parts)

    # ---- engine hooks -----------------------------------------------------------------------------
    def new_state(self, num_layers: int, inv_freq: torch.Tensor | None = None,
                  shard: Shard | None = None) -> MethodState:
        """A conversation's method state; `inv_freq` (the model's RoPE frequencies) is needed by a
        scorer that reads query moments (Scorer.query_moments); `shard`, under tensor parallelism, the
        model's part whose KV heads the conversation holds."""
        window = self.evict.scorer.window if self.evict is not None else 0
        moments_from = self.evict.scorer.query_moments if self.evict is not None else None
        self.prefill.bind(num_layers, shard)
        decode = self.decode.new_state(num_layers) if self.selects_decode else None
        if decode is not None and self.static_sparsity is not None:
            decode.exclude_static(self.static_sparsity)  # LServe: streaming heads never select
        recorder = self.state.query_window(num_layers, max(window, 1 if moments_from is not None else 0))
        if moments_from is not None:
            if inv_freq is None:
                raise ValueError(f"{self.evict.scorer.name} reads query moments: new_state needs inv_freq")
            recorder.moments = QueryMoments(num_layers, inv_freq, moments_from)
        return MethodState(recorder, decode=decode,
                           accumulate=self.accumulates_attention,
                           sparse_prefill=self.prefill if self.sparse_prefill else None)

    @property
    def path_independent(self) -> bool:
        """Whether what a conversation keeps at the end of a turn depends on its token ids alone, not
        on the path that wrote them (which tokens were prompt or reply of which turn, in which chunks):
        nothing is evicted or compressed at any boundary (no eviction axis), the prefill pattern
        attends by position alone, the decode selection starts afresh every turn, the state strategy
        records no more than the last queries, and the previous reply's KV is kept (answer=keep).

        Contract: a conversation that prefills the same tokens in one pass keeps the same tokens in
        every (layer, head), with the same bookkeeping. Values differ only where replies were decoded
        (rounding under dense decode; a selecting decode or a streaming head reads less per step than
        a prefill row). Its turn ends can be shared (turnkv/engine/prefix.py)."""
        return (self.evict is None and self.answer == "keep" and self.prefill.path_independent
                and self.decode.path_independent and self.state.path_independent)

    @property
    def accumulates_attention(self) -> bool:
        return self.evict is not None and self.evict.scorer.accumulates_attention

    @property
    def sparse_prefill(self) -> bool:
        """The prefill axis computes attention itself (a pattern) rather than densely."""
        return self.prefill.sparse

    @property
    def selects_decode(self) -> bool:
        """The decode axis reads a selection of the kept tokens rather than all of them."""
        return self.decode.selects

    @property
    def static_sparsity(self) -> StaticSparsity | None:
        """The prefill component when it also keeps a static pattern in the store (streaming heads,
        whose `trim` keeps their sink + local), or None."""
        return self.prefill if isinstance(self.prefill, StaticSparsity) else None

    def _trim(self, kv, prompt_open: bool = False) -> None:
        if self.static_sparsity is not None:
            self.static_sparsity.trim(kv, prompt_open)

    def after_slice(self, kv) -> None:
        """A prefill slice is in and more of the prompt follows: the static heads drop what the rest
        of the prompt no longer sees."""
        self._trim(kv, prompt_open=True)

    @property
    def compresses_after_prompt(self) -> bool:
        """Whether a turn's prompt ends in an eviction pass over the layers (schedule prefill or prompt),
        work that the step which ends the prompt runs after its forward."""
        return self._scheduled("prefill") or self._scheduled("prompt")

    def after_prompt(self, kv, st: MethodState, segment_end: int, inv_freq, turn: int) -> None:
        """A turn's prompt is prefilled; tokens before `segment_end` belong to finished segments."""
        if st.pattern_stats:
            st.stats.append({"turn": turn, "prefill": {"method": self.prefill.name,
                                                       **summarise(st.pattern_stats, len(kv.lengths))}})
            st.pattern_stats.clear()
        if self._scheduled("prefill"):
            self._compress(kv, st, self.turns.span_end(segment_end, kv.next_position), inv_freq, turn, "prefill")
        if self._scheduled("prompt"):  # the running turn's prompt too; the scorer keeps the window
            self._compress(kv, st, kv.next_position, inv_freq, turn, "prompt")
        self._trim(kv)

    def after_prefix(self, kv, st: MethodState, prefix_end: int, inv_freq, turn: int) -> None:
        """A first turn's prompt is prefilled up to `prefix_end`, the end of its system prompt."""
        if self._scheduled("prefill") and self.turns.closes_prefix:
            self._compress(kv, st, prefix_end, inv_freq, turn, "prefill")

    def after_context(self, kv, st: MethodState, context_end: int, inv_freq, turn: int) -> None:
        if self._scheduled("context"):
            self._compress(kv, st, context_end, inv_freq, turn, "context")
        self._trim(kv)

    def after_decode_step(self, kv, st: MethodState, inv_freq, turn: int) -> None:
        if self._scheduled("decode"):
            st.since_compression += 1
            if st.since_compression >= self.evict.every:
                self._compress(kv, st, kv.next_position, inv_freq, turn, "decode")
        self._trim(kv)

    def at_turn_end(self, kv, st: MethodState, inv_freq, turn: int) -> None:
        if st.decode is not None:
            entry = st.stats[-1] if st.stats and st.stats[-1]["turn"] == turn else None
            if entry is None:
                entry = {"turn": turn}
                st.stats.append(entry)
            entry["decode"] = {"method": self.decode.name, "steps": st.decode.steps,
                               "selections": st.decode.selections}
        if self._scheduled("turn_end"):
            self._compress(kv, st, kv.next_position, inv_freq, turn, "turn_end")

    def _scheduled(self, event: str) -> bool:
        return self.evict is not None and self.evict.schedule == event

    def _compress(self, kv, st: MethodState, hi: int, inv_freq, turn: int, event: str) -> None:
        lo = self.turns.span_start(st.frozen_upto)
        if hi <= lo:
            return
        entry = self.evict.compress(kv, self.turns, lo, hi, st.window, inv_freq)
        st.frozen_upto = max(st.frozen_upto, hi)
        st.since_compression = 0
        if entry is not None:  # the log holds the compressions that evicted something
            st.log.append({"turn": turn, "event": event, **entry})


# ---- presets ----------------------------------------------------------------------------------------
def _preset_table() -> dict[str, dict[str, str]]:
    return {
        "full": {},
        "streaming-llm": {"evict": "streaming_llm"},
        "h2o": {"evict": "h2o"},
        "snapkv": {"evict": "snapkv"},
        "pyramidkv": {"evict": "pyramidkv"},
        "tova": {"evict": "tova"},
        "knorm": {"evict": "knorm"},
        "expected-attention": {"evict": "expected_attention"},
        "random": {"evict": "random"},
        "ada-snapkv": {"evict": "snapkv(kernel=7,pooling=max)+adakv"},  # Ada-KV's code's SnapKV
        "ada-pyramidkv": {"evict": "pyramidkv(kernel=7,pooling=max)+adakv"},
        "ada-expected-attention": {"evict": "expected_attention+adakv"},
        "flowkv": {"evict": "snapkv", "turns": "flowkv"},
        "flowkv-ada-snapkv": {"evict": "snapkv(kernel=7,pooling=max)+adakv", "turns": "flowkv"},
        "loopserve": {"prefill": "loopserve", "decode": "loopserve"},
        "loopserve-p": {"prefill": "loopserve"},
        "loopserve-d": {"decode": "loopserve"},
        "a-shape": {"prefill": "a_shape"},
        "tri-shape": {"prefill": "tri_shape"},
        "minference": {"prefill": "minference"},
        "quest": {"decode": "quest"},
        "duo-attention": {"prefill": "streaming_heads"},
        "lserve": {"prefill": "streaming_heads", "decode": "lserve"},
        "lserve-random": {"prefill": "streaming_heads(pattern=random)", "decode": "lserve"},
        "lserve-static": {"prefill": "streaming_heads"},
        "lserve-dynamic": {"decode": "lserve"},
    }


PRESET_DOCS = {
    "full": "no eviction: the full-cache reference",
    "streaming-llm": "StreamingLLM: 4 sinks + recent tokens",
    "h2o": "H2O: heavy hitters by accumulated attention + recent tokens",
    "snapkv": "SnapKV: observation-window attention, average-pooled",
    "pyramidkv": "PyramidKV: SnapKV scores, budgets falling with depth",
    "tova": "TOVA: attention of the newest query",
    "knorm": "Knorm: smallest key norms",
    "expected-attention": "ExpectedAttention: expected attention of future queries x ||v||",
    "random": "random eviction (control)",
    "ada-snapkv": "Ada-KV head-wise budgets over SnapKV, max-pooled as in Ada-KV's code (Ada-SnapKV)",
    "ada-pyramidkv": "Ada-KV head-wise budgets over PyramidKV (Ada-Pyramid)",
    "ada-expected-attention": "Ada-KV over ExpectedAttention (kvpress's default 'expected_attention')",
    "flowkv": "FlowKV isolation of turns over SnapKV",
    "flowkv-ada-snapkv": "FlowKV isolation of turns over Ada-SnapKV",
    "loopserve": "LoopServe: adaptive vertical/slash prefill lines + progressive top-B decode selection",
    "loopserve-p": "LoopServe prefill lines only (dense decode)",
    "loopserve-d": "LoopServe progressive decode selection only (dense prefill)",
    "a-shape": "A-shape prefill: 128 sink + 4096 local keys per row",
    "tri-shape": "Tri-shape prefill: A-shape + dense last 128 rows",
    "minference": "MInference-style static vertical-slash prefill from the last 64 queries",
    "quest": "Quest: 16-token pages scored by key min/max, top pages to 4096 tokens per head, every step",
    "duo-attention": "DuoAttention: streaming heads (sink 128 + local 256, 50%) hold and read only their window",
    "lserve": "LServe: streaming heads + hierarchical 64/16 page selection (4096 tokens, reused 4 steps) on dense heads",
    "lserve-random": "LServe on any model: a random 50% of the KV heads stream (no calibrated pattern needed)",
    "lserve-static": "LServe ablation: its streaming heads only (the DuoAttention component)",
    "lserve-dynamic": "LServe ablation: its hierarchical page selection only",
}


def preset(name: str) -> Recipe:
    table = _preset_table()
    if name not in table:
        raise InvalidRequestError(f"unknown recipe {name!r}; presets: {', '.join(table)}")
    spec = dict(table[name])
    if "evict" in spec:
        spec["budget"] = str(DEFAULT_BUDGET)
    return Recipe().with_overrides(spec)


def presets() -> dict[str, Recipe]:
    return {name: preset(name) for name in _preset_table()}


def _named_files(component, named: dict[str, str]):
    """`component` with its file-valued parameters mapped through `named` (see Recipe.with_named_files)."""
    changes = {}
    for param, builtins in getattr(type(component), "file_params", {}).items():
        value = getattr(component, param)
        if value in builtins:
            continue
        if isinstance(value, str) and value in named:
            changes[param] = named[value]
            continue
        allowed = ", ".join(sorted(named)) or "none were named"
        builtin = ", ".join(repr(b) for b in builtins if b is not None)
        raise InvalidRequestError(
            f"{component.name}: {param} must be {builtin} or the name of a file the server was started with "
            f"(--head-pattern NAME=PATH: {allowed}); a request never names a file itself")
    return replace(component, **changes) if changes else component


# ---- parsing helpers --------------------------------------------------------------------------------
def _parse_eviction(spec: str) -> Eviction:
    terms = [t for t in re.split(r"\+(?![^(]*\))", spec) if t.strip()]
    if not 1 <= len(terms) <= 2:
        raise InvalidRequestError(f"evict={spec!r}: write scorer(...) or scorer(...)+allocator(...)")
    scorer_name, scorer_params = parse_term(terms[0])
    allocator_name, allocator_params = parse_term(terms[1]) if len(terms) == 2 else ("uniform", {})
    eviction_params = {}
    for params in (scorer_params, allocator_params):
        for k in list(params):
            if k in EVICTION_KEYS:
                eviction_params[k] = params.pop(k)
    scorer = build("scorer", scorer_name, scorer_params)
    allocator = build("allocator", allocator_name, allocator_params)
    if "budget" not in eviction_params and "keep_ratio" not in eviction_params and "compression_ratio" not in eviction_params:
        eviction_params["budget"] = DEFAULT_BUDGET
    return _make_eviction(scorer, allocator, eviction_params)


def _with_eviction_params(evict: Eviction, params: dict) -> Eviction:
    current = {f.name: getattr(evict, f.name) for f in fields(evict) if f.name not in ("scorer", "allocator")}
    if {"budget", "keep_ratio", "compression_ratio"} & set(params):
        current.pop("budget"), current.pop("keep_ratio")
    return _make_eviction(evict.scorer, evict.allocator, {**current, **params})


def _make_eviction(scorer, allocator, params: dict) -> Eviction:
    params = dict(params)
    if "compression_ratio" in params:  # kvpress's convention: the fraction removed
        params["keep_ratio"] = 1 - float(params.pop("compression_ratio"))
    try:
        return Eviction(scorer=scorer, allocator=allocator, **params)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"eviction: {e}") from None
