"""Runs the decoder over conversations' KV: prefill of new tokens against kept state, and batched
decode steps. Owns no conversation logic; the engine decides what to feed."""

from __future__ import annotations

import contextlib

import torch

from turnkv.attention import decode as decode_kernel
from turnkv.engine import graph_selection
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.model.decoder import Transformer


class ModelRunner:
    """cuda_graphs: replay decode steps from CUDA graphs for batches up to max_batch (CUDA only)."""

    def __init__(self, model: Transformer, pool: PagePool, prefill_chunk: int = 4096, max_model_len: int = 0,
                 cuda_graphs: bool = True, max_batch: int = 32):
        self.model, self.pool, self.prefill_chunk = model, pool, prefill_chunk
        self.device = pool.device
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and decode_kernel.uses_kernel(self.device):
            self.graphs = GraphedDecode(model, pool, max_model_len or model.config.max_position_embeddings, max_batch)

    @torch.inference_mode()
    def forward(self, seqs: list[SequenceKV], token_ids: torch.Tensor, all_logits: bool = False,
                windows: list | None = None, accumulate: bool = False, pattern=None,
                selectors: list | None = None, decoding: bool = False) -> torch.Tensor:
        """Append token_ids [B, T] to each sequence and return fp32 logits: [B, V] at the last token,
        or [B, T, V] with all_logits. On any failure every sequence is rolled back as it was.
        pattern / selectors: a recipe's sparse prefill and per-sequence decode selection (see Step)."""
        B, T = token_ids.shape
        before = [s.next_position for s in seqs]
        try:
            slots = [s.reserve(T) for s in seqs]
            positions = torch.tensor(before, device=self.device)[:, None] + torch.arange(T, device=self.device)
            step = Step(self.pool, seqs, slots, positions, self.model.config.sliding_window, windows, accumulate,
                        pattern, selectors, decoding)
            last = None if all_logits else torch.full((B, 1), T - 1, device=self.device)
            with self._attention_backends(T):
                logits = self.model(token_ids.to(self.device), positions, step, logits_at=last)
        except BaseException:
            for s, p in zip(seqs, before):
                s.truncate(p)
            raise
        return logits if all_logits else logits[:, -1]

    def _attention_backends(self, num_new: int):
        """Decode on CUDA skips cuDNN attention: it builds an execution plan for every new key length,
        and decode meets a new one at every step and in every layer whose length differs (measured on
        an H100: 1.6 -> 38.5 tok/s for Ada-SnapKV's uneven heads, 11.4 -> 48.6 for dense). Prefill
        keeps it, where it is the fastest backend."""
        if self.device.type != "cuda" or num_new > 1:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def prefill(self, seq: SequenceKV, token_ids: list[int], all_logits: bool = False, window=None,
                accumulate: bool = False, pattern=None, selector=None) -> torch.Tensor:
        """Prefill one sequence's new tokens in chunks; returns the logits at the last token ([V]), or
        at every new token ([T, V]) with all_logits. pattern: the recipe's sparse prefill (applied to
        every chunk against all kept history); selector: the sequence's decode selection state, which
        watches the prompt's queries."""
        ids = torch.tensor([token_ids], dtype=torch.int64)
        before = seq.next_position
        outputs = []
        try:
            for start in range(0, ids.shape[1], self.prefill_chunk):
                chunk = ids[:, start : start + self.prefill_chunk]
                last_chunk = start + self.prefill_chunk >= ids.shape[1]
                observe = dict(windows=[window], accumulate=accumulate, pattern=pattern,
                               selectors=[selector] if selector is not None else None)
                if all_logits or last_chunk:
                    outputs.append(self.forward([seq], chunk, all_logits, **observe)[0])
                else:
                    self.forward([seq], chunk, **observe)
        except BaseException:
            seq.truncate(before)
            raise
        return torch.cat(outputs) if all_logits else outputs[-1]

    def decode(self, seqs: list[SequenceKV], tokens: torch.Tensor, windows: list | None = None,
               accumulate: bool = False, selectors: list | None = None) -> torch.Tensor:
        """One decode step for a batch: tokens [B] -> logits [B, V]. selectors: per sequence, a decode
        selection state or None (read every kept token)."""
        selecting = selectors is not None and any(s is not None for s in selectors)
        if self.graphs is None or accumulate or not self.graphs.fits(seqs):
            return self.forward(seqs, tokens.view(-1, 1), windows=windows, accumulate=accumulate,
                                selectors=selectors if selecting else None, decoding=True)
        if not selecting:
            return self._graphed_decode(seqs, tokens, windows)
        # A selection inside the graphs (engine/graph_selection.py), or the eager step where it cannot
        # be (conversations with different selectors in one batch, LoopServe's warm-up beside selecting
        # conversations): the eager step's selection is then handed to the graphs' buffers.
        chooser = graph_selection.for_graphs(self.graphs)
        plan = chooser.plan(seqs, selectors)
        if plan is None:
            logits = self.forward(seqs, tokens.view(-1, 1), windows=windows, selectors=selectors, decoding=True)
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
