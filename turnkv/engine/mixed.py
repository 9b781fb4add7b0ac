"""A mixed step: one forward pass that carries every decoding turn's next token and prefill slices of
waiting prompts (chunked prefill inside the decode batch, as vLLM schedules it).

The tokens of all parts are laid end to end along one sequence axis (batch 1), so every projection,
norm and MLP runs once over all of them. Attention does not mix parts: MixedStep hands each part's
rows to its own Step (engine/step.py), built exactly as a separate forward of that part would build
it, so a part reads and writes the KV, records its recipe's observation window, runs its sparse
prefill pattern or decode selection, as it would alone.

A turn's recipe hooks at prefill boundaries (compression where a separate context or the prompt
ends) run after the forward, through TurnRun.chunk_prefilled, as TurnRun.prefill runs them after its
own forward: a slice is always one of the forwards TurnRun.prefill would run (TurnRun.next_chunk).

Pure-decode steps do not come here: they go through ModelRunner.decode, which replays CUDA graphs; so
do the tokens of turns whose decode selects, where graphs run (rides_mixed_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv import gpu
from turnkv.attention import chunk
from turnkv.engine import graph_selection
from turnkv.engine.step import Step
from turnkv.engine.turn import TurnRun
from turnkv.kv.sequence import reserve_step


@dataclass
class Part:
    """B sequences that each add the same T tokens' worth of rows: a decode group (T = 1, one token per
    sequence) or one prefill slice (B = 1)."""

    seqs: list
    tokens: list[list[int]]  # [B][T]
    contexts: list
    decoding: bool

    @property
    def width(self) -> int:
        return len(self.tokens[0])

    @property
    def size(self) -> int:
        return len(self.seqs) * self.width


class MixedStep:
    """The decoder's AttentionStep over parts laid end to end: q [1, N, Hq, D] with N the parts' sizes
    summed, rows in (part, sequence, token) order."""

    def __init__(self, steps: list[Step], parts: list[Part]):
        self.steps, self.parts = steps, parts

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for step, part in zip(self.steps, self.parts):
            B, T, end = len(part.seqs), part.width, start + part.size
            rows = [t[0, start:end].reshape(B, T, *t.shape[2:]) for t in (q, k, v)]
            outs.append(step.attention(layer, *rows).reshape(part.size, *q.shape[2:]))
            start = end
        return torch.cat(outs)[None]


@torch.inference_mode()
def forward(runner, parts: list[Part]) -> list[torch.Tensor]:
    """One forward over `parts`; returns per part fp32 logits [B, V] at each sequence's last token. On
    any failure every sequence is rolled back as it was (KVCacheFullError included)."""
    seqs = [s for p in parts for s in p.seqs]
    before = [s.next_position for s in seqs]
    device = runner.device
    try:
        steps, ids, positions, last = [], [], [], []
        offset = 0
        for part in parts:
            T = part.width
            start = gpu.upload(torch.tensor([s.next_position for s in part.seqs]), device)
            slots = reserve_step(part.seqs) if T == 1 else [s.reserve(T) for s in part.seqs]
            pos = start[:, None] + torch.arange(T, device=device)  # [B, T]
            steps.append(Step(runner.pool, part.seqs, slots, pos, runner.model.config.sliding_window,
                              part.contexts, part.decoding))
            ids += [t for row in part.tokens for t in row]
            positions.append(pos.reshape(-1))
            last += [offset + (b + 1) * T - 1 for b in range(len(part.seqs))]
            offset += part.size
        # Pinned, non-blocking uploads: a pageable one would hold the host until the device ran
        # everything queued before it (a graphed decode launched ahead of these slices).
        token_ids = gpu.upload(torch.tensor([ids], dtype=torch.int64), device)
        at = gpu.upload(torch.tensor([last]), device)
        with chunk.sdpa_backends(device, max(p.width for p in parts)):
            logits = runner.model(token_ids, torch.cat(positions)[None], MixedStep(steps, parts), logits_at=at)[0]
    except BaseException:
        for s, p in zip(seqs, before):
            s.truncate(p)
        raise
    if runner.graphs is not None:  # the graphs' selection buffers follow an eager step's selection
        for part in parts:
            selectors = [c.selector if c is not None else None for c in part.contexts]
            if part.decoding and any(s is not None for s in selectors):
                graph_selection.for_graphs(runner.graphs).after_eager(part.seqs, selectors)
    return list(logits.split([len(p.seqs) for p in parts]))


def rides_mixed_step(runner, turn: TurnRun) -> bool:
    """Whether a decoding turn's next token goes into a mixed forward. Not where its decode selects
    and the runner replays CUDA graphs: the graphed step selects for the whole batch inside its
    graphs, with its host planning once per step, where an eager step plans and launches each
    layer's selection and statistics fold from the host (engine/selection.py). Such turns take a
    graphed decode step beside the mixed forward."""
    return runner.graphs is None or turn.context.selector is None


def decode_part(batch: list[TurnRun]) -> Part:
    """A decode group (decode_loop.batches) as a part: each turn fed its last token."""
    return Part([t.seq for t in batch], [[t.gen.token_ids[-1]] for t in batch], [t.context for t in batch], True)


def slice_part(turn: TurnRun, size: int) -> Part:
    """The next prefill forward of `turn`, of at most `size` tokens, as a part."""
    return Part([turn.seq], [turn.next_chunk(size)], [turn.context], False)
