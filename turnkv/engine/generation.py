"""The state of one request while it generates: sampling, stop conditions, text and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from turnkv.engine.detokenizer import IncrementalDetokenizer
from turnkv.engine.logits import Constraint, LogitsProcessor, TokenLogprob, token_logprob
from turnkv.engine.sampling import SamplingParams, sample
from turnkv.kv.sequence import SequenceKV


@dataclass
class Reply:
    """What a turn produced, with its cost."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "forced" (teacher forcing ran out)
    prompt_tokens: int  # tokens prefilled for this turn
    cached_tokens: int  # earlier tokens whose kept KV the turn reused instead of recomputing
    completion_tokens: int
    ttft_s: float
    decode_s: float
    kv_tokens: int  # tokens held in the KV store, summed over layers and heads
    kv_bytes: int  # bytes of the pages the conversation holds, shared ones included
    logprobs: torch.Tensor | None = None  # [completion_tokens, V] when asked for (fidelity metrics)
    # Seconds from the turn's start at which each token was accepted (read on the host).
    token_times: list[float] | None = None
    # Per generated token when SamplingParams.logprobs is set: its log-probability and alternatives.
    token_logprobs: list[TokenLogprob] | None = None
    # kv_bytes split: pages only this conversation holds, and its share of the pages it holds with
    # others (each such page's bytes over its number of holders).
    kv_own_bytes: int = 0
    kv_shared_bytes: int = 0
    # Whether `text` is every generated token's (special tokens render as nothing there), not cut by
    # a stop string.
    text_complete: bool = True

    @property
    def time_per_token_s(self) -> float:
        return self.decode_s / max(1, self.completion_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


class Generation:
    """Accepts one sampled token at a time and decides when to stop."""

    def __init__(self, seq: SequenceKV, params: SamplingParams, tokenizer, eos_ids: set[int],
                 vocab_limit: int | None, max_positions: int, device: torch.device,
                 forced: list[int] | None = None, keep_logprobs: bool = False,
                 constraint: Constraint | None = None):
        self.seq, self.params = seq, params
        # Teacher forcing: feed these tokens instead of sampling (to compare distributions along a
        # reference answer); keep_logprobs records each step's log-softmax.
        self.forced = forced
        self.logprobs: list[torch.Tensor] | None = [] if keep_logprobs else None
        # Log-probabilities of the model's distribution (before penalties, biases or a grammar).
        self.token_logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.processor = None
        if params.processes_logits or constraint is not None:
            self.processor = LogitsProcessor(params.frequency_penalty, params.presence_penalty, params.logit_bias,
                                             device, constraint)
        self.eos_ids = set() if params.ignore_eos else eos_ids
        self.vocab_limit, self.max_positions = vocab_limit, max_positions
        self.detok = IncrementalDetokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token_at: float | None = None

    def limit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            return logits[..., : self.vocab_limit]  # ids the tokenizer cannot decode are never produced
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        logits = self.limit_vocab(logits)
        if self.logprobs is not None:
            self.logprobs.append(logits.float().log_softmax(-1).cpu())
        if self.forced is not None:
            return self.forced[len(self.token_ids)]
        processed = logits if self.processor is None else self.processor.apply(logits)
        token = int(sample(processed, self.params, self.generator))
        if self.token_logprobs is not None:
            self.token_logprobs.append(token_logprob(logits, token, self.params.logprobs))
        return token

    @property
    def runs_ahead(self) -> bool:
        """Whether a step may be launched before this generation's last token is read (nothing it
        samples with depends on the tokens before)."""
        return self.forced is None and self.logprobs is None and self.token_logprobs is None and self.processor is None

    def accept(self, token: int, ahead: bool = False) -> str:
        """Record a sampled token; return the text it made final. Sets finish_reason when done.
        ahead: the sequence already holds the next step's token (engine/decode_loop.py)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.append(token)
        self.token_times.append(time.perf_counter())
        piece = ""
        if self.processor is not None:
            self.processor.accept(token)
        if token in self.eos_ids or (self.processor is not None and self.processor.finished):
            self.finish_reason = "stop"
            if token not in self.eos_ids and self.detok is not None:
                piece = self.detok.push(token)
        elif self.detok is not None:
            piece = self.detok.push(token)
            if self.detok.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None:
            # The token is fed back at position next_position, which must stay inside the context.
            if self._at_length(len(self.token_ids), self.seq.next_position - ahead):
                self.finish_reason = "length"
            elif self.forced is not None and len(self.token_ids) >= len(self.forced):
                self.finish_reason = "forced"
        if self.finish_reason is not None and self.detok is not None:
            piece += self.detok.flush()
        return piece

    def end(self, reason: str) -> str:
        """Stop after the tokens accepted so far (the caller can run no further step); returns the
        text held back until now (a stop string's possible start, an incomplete character)."""
        if self.finish_reason is not None:
            return ""
        self.finish_reason = reason
        return self.detok.flush() if self.detok is not None else ""

    def _at_length(self, num_tokens: int, next_position: int) -> bool:
        return num_tokens >= self.params.max_new_tokens or next_position + 1 >= self.max_positions

    def stops_by_length_next(self) -> bool:
        """Whether the next token accepted (the sequence holding the step that samples it) ends the
        generation by length: known before the token is."""
        return self._at_length(len(self.token_ids) + 1, self.seq.next_position)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def reply(self, prompt_tokens: int, cached_tokens: int) -> Reply:
        end = time.perf_counter()
        first = self.first_token_at or end
        own, share = self.seq.sharing()
        return Reply(
            text=self.detok.text if self.detok is not None else "",
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=len(self.token_ids),
            ttft_s=first - self.started,
            decode_s=end - first,
            kv_tokens=self.seq.tokens(),
            kv_bytes=self.seq.bytes(),
            logprobs=torch.stack(self.logprobs) if self.logprobs else None,
            token_times=[t - self.started for t in self.token_times],
            token_logprobs=None if self.token_logprobs is None else list(self.token_logprobs),
            kv_own_bytes=own, kv_shared_bytes=share,
            text_complete=self.detok is None or not self.detok.stopped,
        )
