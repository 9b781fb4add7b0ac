"""Decode a batch of generations to their end, one step ahead of the host where it can.

Reading a sampled token on the host waits for the GPU to finish its step, and the next step's host
work (detokenising, stop checks, the step's metadata) then runs while the GPU idles: 0.7-1.1 ms of
an 8-9 ms step at batch 1 on an H100 (profiled). So where decode replays from CUDA graphs, the loop
launches step k with step k-1's tokens still on the device, and reads step k-1's tokens while step k
runs.

What that costs is exactness bookkeeping, not results. A generation that stops at step k-1's token
(an end-of-sequence token, a stop string: only known once the token is read) had step k launched for
nothing: its token's reservation is undone and the step's output dropped. A step's bookkeeping, which
later steps or turns see (the observation window's queries, the recipe's per-step hook), runs only
once the step is known to count, and before the next step is launched: the device sees the same
operations in the same order as one step at a time. Stops by length are known ahead and never cost
an extra step.

The loop runs one step at a time (reading every token before the next step) where running ahead
would change what is computed or cannot be undone: teacher forcing and kept log-probabilities (they
read each step's logits), decode selection (its state advances every step), attention accumulation
(H2O: every step adds to the kept mass), and steps that do not replay from the graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from turnkv.engine.generation import Generation
from turnkv.engine.sampling import sample


def decode(llm, recipe, gens: list[Generation], states: list, turn: int) -> Iterator[tuple[int, str]]:
    """Decode every generation of `gens` (each has accepted its first token) until it is done, with
    the recipe's per-sequence method states. Yields (index, text made final) per accepted token."""
    active = [i for i, g in enumerate(gens) if not g.done]
    if not active:
        return
    if _can_run_ahead(llm, recipe, [gens[i] for i in active], [states[i] for i in active]):
        yield from _ahead(llm, recipe, gens, states, active, turn)
    else:
        yield from _one_at_a_time(llm, recipe, gens, states, turn)


def _one_at_a_time(llm, recipe, gens, states, turn):
    inv_freq = llm.model.inv_freq
    while True:
        active = [i for i, g in enumerate(gens) if not g.done]
        if not active:
            return
        logits = llm.runner.decode([gens[i].seq for i in active], llm.token_tensor([gens[i].token_ids[-1] for i in active]),
                                   windows=[states[i].window for i in active], accumulate=recipe.accumulates_attention,
                                   selectors=[states[i].decode for i in active])
        for row, i in zip(logits, active):
            recipe.after_decode_step(gens[i].seq, states[i], inv_freq, turn)
            piece = gens[i].accept(gens[i].sample(row))
            yield i, piece


def _can_run_ahead(llm, recipe, gens, states) -> bool:
    graphs = llm.runner.graphs
    if graphs is None or recipe.accumulates_attention or any(st.decode is not None for st in states):
        return False
    if any(g.forced is not None or g.logprobs is not None for g in gens):
        return False
    if len(gens) > graphs.buckets[-1]:
        return False
    # Every step must replay from the graphs, up to the last position a generation can reach.
    last = max(g.seq.next_position + g.params.max_new_tokens for g in gens)
    return last < graphs.capacity


class _HostTokens:
    """Two buffers the sampled tokens cross to the host in, asynchronously: one step's tokens are
    copied while the host reads the previous step's."""

    def __init__(self, size: int, device: torch.device):
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.turn = 0

    def send(self, tokens: torch.Tensor) -> int:
        k = self.turn % 2
        self.turn += 1
        self.buffers[k][: tokens.numel()].copy_(tokens, non_blocking=True)
        if self.events is not None:
            self.events[k].record()
        return k

    def read(self, k: int, n: int) -> list[int]:
        if self.events is not None:
            self.events[k].synchronize()
        return self.buffers[k][:n].tolist()


def _sample_rows(gens: list[Generation], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V], on the device (no host read)."""
    limits = {g.vocab_limit for g in gens}
    if all(g.params.greedy for g in gens) and len(limits) == 1:
        limit = limits.pop()
        return (logits if limit is None else logits[:, :limit]).argmax(dim=-1)
    return torch.stack([sample(g.limit_vocab(row), g.params, g.generator) for g, row in zip(gens, logits)])


def _ahead(llm, recipe, gens, states, rows, turn):
    runner, inv_freq = llm.runner, llm.model.inv_freq
    host = _HostTokens(len(rows), llm.device)
    inputs = llm.token_tensor([gens[i].token_ids[-1] for i in rows])
    unread = None  # (rows, host buffer) of the last launched step, whose tokens are not read yet
    while rows or unread is not None:
        launched = None
        if rows:  # step k, fed step k-1's tokens on the device
            out = _sample_rows([gens[i] for i in rows], runner.decode([gens[i].seq for i in rows], inputs))
            launched = (rows, out, host.send(out))
        if unread is not None:  # step k-1's tokens, read while step k runs
            ahead = set(rows)  # these sequences already hold step k's token
            for i, token in zip(unread[0], host.read(unread[1], len(unread[0]))):
                if not gens[i].done:  # a row that stopped earlier had this step undone
                    yield i, gens[i].accept(token, ahead=i in ahead)
        if launched is None:
            return
        step_rows, out, buffer = launched
        counted = [j for j, i in enumerate(step_rows) if not gens[i].done]
        for i in step_rows:
            if gens[i].done:  # it stopped at the token step k consumed: step k was for nothing
                gens[i].seq.unreserve(1)
        _bookkeeping(llm, recipe, gens, states, step_rows, counted, inv_freq, turn)
        unread = (step_rows, buffer)
        # Step k+1: every counted row whose token from step k will not be its last by length.
        going_on = [j for j in counted if not gens[step_rows[j]].stops_by_length_next()]
        rows = [step_rows[j] for j in going_on]
        if rows and len(going_on) != len(step_rows):
            inputs = out[torch.tensor(going_on, device=out.device)]
        elif rows:
            inputs = out


def _bookkeeping(llm, recipe, gens, states, step_rows, counted, inv_freq, turn) -> None:
    """A counted step's observation (its queries into the windows) and the recipe's per-step hook,
    before the next step is launched, as the one-at-a-time loop orders them."""
    windows = [states[i].window if j in counted else None for j, i in enumerate(step_rows)]
    if any(w is not None for w in windows):
        llm.runner.graphs.record_windows([gens[i].seq for i in step_rows], windows)
    for j in counted:
        i = step_rows[j]
        recipe.after_decode_step(gens[i].seq, states[i], inv_freq, turn)
