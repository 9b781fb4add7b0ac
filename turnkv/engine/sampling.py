"""Sampling parameters and token selection: greedy, temperature, top-k, top-p, per-request seeds.

Selection stays on the device: the exponential-race trick draws from the categorical distribution
without a host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from turnkv.errors import InvalidRequestError

# The seeds torch.Generator.manual_seed takes.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How a reply is sampled; send(), stream() and generate() take these as keywords.

    max_new_tokens: reply length limit. temperature: 0 is greedy. top_p: nucleus mass kept (1: all).
    top_k: sample among the k likeliest tokens (0: all). seed: per-request seed (None: unseeded).
    stop: strings that end the reply (not included in it). ignore_eos: generate past end-of-sequence
    tokens (benchmarks). InvalidRequestError for a value out of range."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence of a token in this generation
    presence_penalty: float = 0.0  # subtracted once from every token this generation produced
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    logprobs: int | None = None  # keep each token's log-probability and this many alternatives (0..20)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
             and self.max_new_tokens >= 1, "max_new_tokens must be an integer >= 1"),
            (_is_number(self.temperature) and 0 <= self.temperature <= 100, "temperature must be a number in [0, 100]"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be a number in (0, 1]"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
             "top_k must be an integer >= 0"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty must be a number in [-2, 2]"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty must be a number in [-2, 2]"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 and _is_number(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items())),
             "logit_bias must map token ids (integers >= 0) to numbers in [-100, 100]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
             f"logprobs (the alternatives kept per token) must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def processes_logits(self) -> bool:
        """Whether a row of logits changes before sampling (penalties, biases)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token from fp32 logits [V]; returns a 0-dim int64 tensor on the logits' device."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)
