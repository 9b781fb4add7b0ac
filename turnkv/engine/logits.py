"""Per-request changes to a row of logits before a token is sampled, and the log-probabilities a
request asked to see.

A batched decode step produces logits [B, V]; each row goes to its own request's Generation, which
runs its LogitsProcessor on that row alone, so one request's penalties, biases or grammar never touch
another's row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Constraint(Protocol):
    """A grammar a generation must follow (structured output, a required tool call)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar forbids next set to -inf."""

    def accept(self, token: int) -> None:
        """The token was generated."""

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the generation stops)."""


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model, and the `top` most likely tokens at
    that step as (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-softmax of fp32 logits [V] at `token`, and its `top` largest entries."""
    logprobs = logits.float().log_softmax(-1)
    chosen = float(logprobs[token])
    if not top:
        return TokenLogprob(token, chosen, [])
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]))
    return TokenLogprob(token, chosen, list(zip(ids.tolist(), values.tolist())))


class LogitsProcessor:
    """OpenAI's frequency and presence penalties (over the tokens this request generated), its
    logit_bias, and a grammar constraint, applied to one request's row of logits [V]."""

    def __init__(self, frequency_penalty: float, presence_penalty: float, logit_bias: dict[int, float] | None,
                 device: torch.device, constraint: Constraint | None = None):
        self.frequency, self.presence, self.constraint = frequency_penalty, presence_penalty, constraint
        self.device = device
        self.counts: torch.Tensor | None = None  # [V] float32: how often each token was generated
        self.bias = None
        if logit_bias:
            ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=device)
            self.bias = (ids, torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device))

    @property
    def penalizes(self) -> bool:
        return bool(self.frequency or self.presence)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.penalizes:
            if self.counts is None:
                self.counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            counts = self.counts
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        if self.bias is not None:
            ids, values = self.bias
            logits = logits.index_add(-1, ids, values)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return logits

    def accept(self, token: int) -> None:
        if self.counts is not None and token < self.counts.shape[0]:
            self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    @property
    def finished(self) -> bool:
        return self.constraint is not None and self.constraint.finished
