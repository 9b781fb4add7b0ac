"""The step loop: every caller decodes its turns (engine/turn.py) through it.

step() is one batched decode step: batches() groups the turns that can share a forward, forward() runs
each batch, then each turn's row is postprocessed (the recipe's per-step hook, then the token).
decode() runs steps until every turn is done; where steps replay from CUDA graphs it launches step k
before reading step k-1's tokens, and undoes a step launched for nothing (discard_step), so the device
sees the same operations in the same order as one step at a time.
Design: docs/architecture.md#the-decode-step-loop"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from turnkv.engine.generation import Generation
from turnkv.engine.sampling import sample
from turnkv.engine.turn import TurnRun
from turnkv.methods.step_context import StepContext


def batches(turns: list[TurnRun], max_batch: int = 32) -> list[list[TurnRun]]:
    """Schedule: the unfinished turns, grouped into batches that share one forward (a batch agrees
    on attention accumulation, and on whether it selects), at most max_batch each."""
    kinds: dict[tuple[bool, bool], list[TurnRun]] = {}
    for turn in turns:
        if not turn.done:
            ctx = turn.context
            kinds.setdefault((ctx.accumulate, ctx.selector is not None), []).append(turn)
    return [group[i : i + max_batch] for group in kinds.values() for i in range(0, len(group), max_batch)]


def forward(llm, batch: list[TurnRun]) -> torch.Tensor:
    """Run: one decode step of `batch`, each fed its last token -> logits [B, V]. The turns are settled
    (step() and decode() settle them; the server settles each after its first token)."""
    tokens = llm._token_tensor([t.gen.token_ids[-1] for t in batch])
    return llm.runner.decode([t.seq for t in batch], tokens, [t.context for t in batch])


def step(llm, turns: list[TurnRun], max_batch: int = 32) -> list[tuple[TurnRun, str]]:
    """One decode step of every unfinished turn; returns (turn, text made final) per turn."""
    for turn in turns:
        if not turn.done:
            turn.settle()  # its after-prompt hook, if its prefill deferred it: before its first step
    out = []
    for batch in batches(turns, max_batch):
        logits = forward(llm, batch)
        out += [(turn, turn.after_step(row)) for turn, row in zip(batch, logits)]
    return out


def decode(llm, turns: list[TurnRun]) -> Iterator[tuple[int, str]]:
    """Decode every turn of `turns` (each has taken its first token) until it is done. Yields
    (index, text made final) per accepted token."""
    active = [t for t in turns if not t.done]
    if not active:
        return
    for turn in active:
        turn.settle()
    if _can_run_ahead(llm, active):
        yield from _ahead(llm, turns)
        return
    index = {id(t): i for i, t in enumerate(turns)}
    while any(not t.done for t in turns):
        for turn, piece in step(llm, turns):
            yield index[id(turn)], piece


def _can_run_ahead(llm, turns: list[TurnRun]) -> bool:
    graphs = llm.runner.graphs
    if graphs is None or len(turns) > graphs.buckets[-1]:
        return False
    for t in turns:
        ctx = t.context
        if ctx.accumulate or (ctx.selector is not None and ctx.window is not None):
            return False
        if not t.gen.runs_ahead:
            return False
    # Every step must replay from the graphs, up to the last position a generation can reach.
    last = max(t.seq.next_position + t.gen.params.max_new_tokens for t in turns)
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


def _ahead(llm, turns: list[TurnRun]):
    host = _HostTokens(len(turns), llm.device)
    rows = [i for i, t in enumerate(turns) if not t.done]
    gens = [t.gen for t in turns]
    inputs = llm._token_tensor([gens[i].token_ids[-1] for i in rows])
    unread = None  # (rows, host buffer) of the last launched step, whose tokens are not read yet
    while rows or unread is not None:
        launched = None
        if rows:  # step k, fed step k-1's tokens on the device
            logits = llm.runner.decode([turns[i].seq for i in rows], inputs,
                                       [_without_window(turns[i].context) for i in rows])
            out = _sample_rows([gens[i] for i in rows], logits)
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
                _discard_step(turns[i])
        _bookkeeping(llm, turns, step_rows, counted)
        unread = (step_rows, buffer)
        # Step k+1: every counted row whose token from step k will not be its last by length.
        going_on = [j for j in counted if not gens[step_rows[j]].stops_by_length_next()]
        rows = [step_rows[j] for j in going_on]
        if rows and len(going_on) != len(step_rows):
            inputs = out[torch.tensor(going_on, device=out.device)]
        elif rows:
            inputs = out


def _without_window(context: StepContext) -> StepContext:
    """The step's context at launch: windows are filled in by _bookkeeping once the step counts."""
    return context if context.window is None else replace(context, window=None)


def _discard_step(turn: TurnRun) -> None:
    """Undo a launched step that turned out to follow the generation's last token."""
    position = turn.seq.next_position - 1
    turn.seq.unreserve(1)
    if turn.context.selector is not None:
        turn.context.selector.discard_step(turn.seq, position)


def _bookkeeping(llm, turns, step_rows, counted) -> None:
    """A counted step's observation (its queries into the windows) and the recipe's per-step hook,
    before the next step is launched, as the one-at-a-time loop orders them."""
    windows = [turns[i].context.window if j in counted else None for j, i in enumerate(step_rows)]
    if any(w is not None for w in windows):
        llm.runner.graphs.record_windows([turns[i].seq for i in step_rows], windows)
    for j in counted:
        turns[step_rows[j]].after_step_hook()
