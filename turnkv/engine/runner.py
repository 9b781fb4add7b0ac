"""Runs the decoder over conversations' KV: prefill of new tokens against kept state, and batched
decode steps. Owns no conversation logic; the engine decides what to feed."""

from __future__ import annotations

import torch

from turnkv import gpu
from turnkv.attention import chunk
from turnkv.attention import decode as decode_kernel
from turnkv.engine import graph_selection
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.engine.graph_prefill import GraphedPrefill
from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV, reserve_step
from turnkv.methods.step_context import StepContext
from turnkv.model.decoder import Transformer


class ModelRunner:
    """cuda_graphs: replay decode steps from CUDA graphs for batches up to max_batch, and short prefill
    chunks of one sequence (engine/graph_prefill.py), on CUDA only."""

    def __init__(self, model: Transformer, pool: PagePool, prefill_chunk: int = 4096, max_model_len: int = 0,
                 cuda_graphs: bool = True, max_batch: int = 32):
        self.model, self.pool, self.prefill_chunk = model, pool, prefill_chunk
        self.device = pool.device
        self.graphs = self.prefill_graphs = None
        if cuda_graphs and self.device.type == "cuda" and decode_kernel.uses_kernel(self.device):
            self.graphs = GraphedDecode(model, pool, max_model_len or model.config.max_position_embeddings, max_batch)
            self.prefill_graphs = GraphedPrefill(self.graphs)

    def drop_graphs(self) -> None:
        """Let go of every captured CUDA graph; later steps run eagerly. A tensor-parallel engine's rank 0
        calls it at shutdown, before its NCCL group is aborted (turnkv/parallel/launch.py)."""
        if self.graphs is not None:
            torch.cuda.synchronize(self.device)
            self.graphs.close()
            self.graphs = self.prefill_graphs = None

    @property
    def graph_batch(self) -> int | None:
        """The largest decode batch replayed from CUDA graphs (None without graphs): a caller with more
        sequences decodes them in batches of this size rather than in one eager step."""
        return None if self.graphs is None else self.graphs.buckets[-1]

    @torch.inference_mode()
    def forward(self, seqs: list[SequenceKV], token_ids: torch.Tensor, all_logits: bool = False,
                contexts: list[StepContext | None] | None = None, decoding: bool = False) -> torch.Tensor:
        """Append token_ids [B, T] to each sequence and return fp32 logits: [B, V] at the last token,
        or [B, T, V] with all_logits. On any failure every sequence is rolled back as it was.
        contexts: per sequence, what its recipe asks of the step (StepContext; None: nothing)."""
        B, T = token_ids.shape
        before = [s.next_position for s in seqs]
        try:
            slots = reserve_step(seqs) if T == 1 else [s.reserve(T) for s in seqs]
            positions = gpu.upload(torch.tensor(before), self.device)[:, None] + torch.arange(T, device=self.device)
            step = Step(self.pool, seqs, slots, positions, self.model.config.sliding_window, contexts, decoding)
            last = None if all_logits else torch.full((B, 1), T - 1, device=self.device)
            with chunk.sdpa_backends(self.device, T):
                logits = self.model(token_ids.to(self.device), positions, step, logits_at=last)
        except BaseException:
            for s, p in zip(seqs, before):
                s.truncate(p)
            raise
        return logits if all_logits else logits[:, -1]

    def prefill(self, seq: SequenceKV, token_ids: list[int], all_logits: bool = False,
                context: StepContext | None = None) -> torch.Tensor:
        """Prefill one sequence's new tokens in chunks; returns the logits at the last token ([V]), or
        at every new token ([T, V]) with all_logits. context: the recipe's hooks (its sparse pattern
        runs on every chunk against all kept history; its decode selection watches the queries)."""
        ids = torch.tensor([token_ids], dtype=torch.int64)
        before = seq.next_position
        outputs = []
        contexts = [context]
        try:
            for start in range(0, ids.shape[1], self.prefill_chunk):
                chunk = ids[:, start : start + self.prefill_chunk]
                last_chunk = start + self.prefill_chunk >= ids.shape[1]
                graphed = self.prefill_graphs
                if not all_logits and graphed is not None and graphed.takes(seq, chunk.shape[1], context):
                    outputs.append(graphed.prefill(seq, token_ids[start : start + self.prefill_chunk], context))
                elif all_logits or last_chunk:
                    outputs.append(self.forward([seq], chunk, all_logits, contexts)[0])
                else:
                    self.forward([seq], chunk, contexts=contexts)
        except BaseException:
            seq.truncate(before)
            raise
        return torch.cat(outputs) if all_logits else outputs[-1]

    @torch.inference_mode()
    def decode(self, seqs: list[SequenceKV], tokens: torch.Tensor,
               contexts: list[StepContext | None] | None = None) -> torch.Tensor:
        """One decode step for a batch: tokens [B] -> logits [B, V]. contexts: per sequence, what its
        recipe asks of the step (a batch agrees on `accumulate`)."""
        contexts = contexts or [None] * len(seqs)
        selectors = [c.selector if c is not None else None for c in contexts]
        windows = [c.window if c is not None else None for c in contexts]
        windows = windows if any(w is not None for w in windows) else None
        accumulate = any(c is not None and c.accumulate for c in contexts)
        selecting = any(s is not None for s in selectors)
        if self.graphs is None or accumulate or not self.graphs.fits(seqs):
            return self.forward(seqs, tokens.view(-1, 1), contexts=contexts, decoding=True)
        if not selecting:
            return self._graphed_decode(seqs, tokens, windows)
        # A selection inside the graphs (engine/graph_selection.py), or the eager step where it cannot
        # be (conversations with different selectors in one batch, LoopServe's warm-up beside selecting
        # conversations): the eager step's selection is then handed to the graphs' buffers.
        chooser = graph_selection.for_graphs(self.graphs)
        plan = chooser.plan(seqs, selectors)
        # Tensor parallel (pool.agree set): whether a plan exists depends on the rank's own heads' lengths, and
        # the graphed and eager steps run all-reduces of different shapes (a graph's bucket pads the batch).
        # The ranks replay only where every rank has a plan (one host collective, as PagePool.room's), else
        # all take the eager step, a rank's plan dropped as is (Plan). Their variants may differ: each runs
        # the decoder's collectives at the bucket's shape. `fits` above reads the batch size and positions,
        # the same on every rank.
        if self.pool.agree is not None and self.pool.agree([int(plan is None)])[0]:
            plan = None
        if plan is None:
            logits = self.forward(seqs, tokens.view(-1, 1), contexts=contexts, decoding=True)
            chooser.after_eager(seqs, selectors)
            return logits
        return self._graphed_decode(seqs, tokens, windows, plan)

    @torch.inference_mode()
    def _graphed_decode(self, seqs, tokens, windows, plan=None):
        self.graphs.variant = None if plan is None else plan.variant
        try:
            logits = self.graphs.step(seqs, tokens)  # reserves the new token's slots; all or nothing
        finally:
            self.graphs.variant = None
        if plan is not None:
            plan.after(seqs)
        if windows is not None:
            self.graphs.record_windows(seqs, windows)
        return logits.clone()
