"""The server's warm-up: synthetic conversations run through the scheduler before it takes requests.

On a GPU the first step of each kind compiles what it runs: Triton kernels, cuDNN plans, the decode
graph of each batch bucket. Unwarmed, the first users pay seconds for each (a mixed step of a 2048-token
slice beside six decoding streams took 21 s on an H100) while every running stream waits. The warm-up
plays, through the same worker and with the server's default recipe:

1. `conversations` first turns at once, each prompt spanning two and a half prefill slices, so that
   slices run alone, beside other slices and beside decoding streams (mixed steps);
2. a later turn of each, short, over the kept history (the later-turn kernels);
3. for each decode bucket up to the server's ceiling, that many short requests at once (one decode
   graph per bucket).

It records into a scratch Metrics (the server's /metrics starts at zero) and flushes what it kept
(conversations and prefix-index entries) at its end: the first user finds the pool empty.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from turnkv.engine.cuda_graphs import BUCKETS
from turnkv.serve import chat as chat_requests
from turnkv.serve.job import Job
from turnkv.serve.metrics import Metrics
from turnkv.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("turnkv.serve")

SESSION_PREFIX = "turnkv-warmup-"


@dataclass
class WarmupReport:
    seconds: float = 0.0
    requests: int = 0
    prompt_tokens: list[int] = field(default_factory=list)  # each first turn's prompt
    cached_tokens: list[int] = field(default_factory=list)  # each later turn's tokens taken from its history
    batches: list[int] = field(default_factory=list)  # the sizes of the request waves of step 3
    mixed_steps: float = 0.0  # steps that carried decode tokens and prefill slices together


class _Waiter:
    """A job's sink: keeps its outcome (or error) and wakes whoever waits for it."""

    def __init__(self):
        self.done, self.outcome, self.error = threading.Event(), None, None

    def __call__(self, kind: str, payload) -> None:
        if kind == "done":
            self.outcome = payload
        elif kind == "error":
            self.error = payload
        if kind in ("done", "error"):
            self.done.set()


def wanted(setting: bool | None, llm) -> bool:
    """ServeConfig.warmup: None means on where the engine compiles (a CUDA device)."""
    return setting if setting is not None else llm.device.type == "cuda"


def warm_up(scheduler, recipes, conversations: int = 4, reply_tokens: int = 24, timeout_s: float = 600.0):
    """Run the warm-up (module docstring) on a started scheduler; returns a WarmupReport. A request of it
    that fails raises RuntimeError: the server would fail the same way for its first users."""
    llm, config = scheduler.llm, scheduler.config
    report, start = WarmupReport(), time.perf_counter()
    recipe, key = recipes.resolve(None)
    real, scheduler.metrics = scheduler.metrics, Metrics("warmup")
    try:
        slice_tokens = scheduler.gate.slice_tokens
        budget = llm.max_model_len - 2 * reply_tokens - 64  # room for the later turn and its reply
        # A quarter of the pool at most for all of them (whole heads, every turn kept): a small pool gets
        # fewer and shorter conversations, never a pool-full error.
        pool_tokens = llm.pool.num_pages * llm.pool.page_size // llm.pool.num_kv_heads
        # Past where the recipe's prefill changes paths (LServe's windowed chunks), by a slice or more.
        wanted_len = max(2 * slice_tokens + slice_tokens // 2, recipe.prefill.paths_change_at() + slice_tokens)
        prompt_len = max(16, min(wanted_len, budget, pool_tokens // 4 - 4 * reply_tokens))
        per_conversation = prompt_len + 4 * reply_tokens + 2 * llm.pool.page_size
        conversations = max(1, min(conversations, config.max_running, pool_tokens // 4 // per_conversation))
        chats = llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None) is not None

        def run(jobs: list[Job]) -> list:
            waiters = [job.sink for job in jobs]
            for job in jobs:
                scheduler.submit(job)
            deadline = time.monotonic() + timeout_s
            for w in waiters:
                if not w.done.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"the server's warm-up did not finish within {timeout_s:.0f} s")
                if w.error is not None:
                    raise RuntimeError(f"the server's warm-up failed: {w.error}") from w.error
            report.requests += len(jobs)
            return [w.outcome for w in waiters]

        def job(req, **inputs) -> Job:
            return Job(_Waiter(), req.sampling(), req.max_tokens, req.max_tokens, recipe, key, **inputs)

        if chats:
            firsts = [[{"role": "user", "content": _text(llm.tokenizer, i, prompt_len)}] for i in range(conversations)]
            outcomes = run([_chat_job(job, llm, m, i, reply_tokens) for i, m in enumerate(firsts)])
            report.prompt_tokens = [o.prompt_tokens for o in outcomes]
            seconds = [m + [{"role": "assistant", "content": o.text},
                            {"role": "user", "content": _text(llm.tokenizer, 1000 + i, 24)}]
                       for i, (m, o) in enumerate(zip(firsts, outcomes))]
            outcomes = run([_chat_job(job, llm, m, i, reply_tokens) for i, m in enumerate(seconds)])
            report.cached_tokens = [o.cached_tokens for o in outcomes]
        else:  # no chat template: token prompts (no later turns: a completion keeps no conversation)
            prompt = list(range(1, prompt_len + 1))
            outcomes = run([job(_completion(prompt, reply_tokens), prompt=[(t + i) % llm.config.vocab_size or 1
                                                                           for t in prompt])
                            for i in range(conversations)])
            report.prompt_tokens = [o.prompt_tokens for o in outcomes]
        for batch in (b for b in BUCKETS if b <= config.max_running):
            short = list(range(7, 23))
            run([job(_completion(short, 4), prompt=[(t * (i + 3)) % llm.config.vocab_size or 1 for t in short])
                 for i in range(batch)])
            report.batches.append(batch)
        report.mixed_steps = _count(scheduler.metrics.mixed_steps)
    finally:
        scheduler.metrics = real
        scheduler.flush()
    report.seconds = time.perf_counter() - start
    log.info("warmed up in %.1f s: %d requests (first turns of %s prompt tokens, later turns over %s kept, "
             "%d mixed steps, decode batches up to %d)", report.seconds, report.requests,
             sorted(set(report.prompt_tokens)), sorted(set(report.cached_tokens)) or "no", report.mixed_steps,
             max(report.batches, default=0))
    return report


def _chat_job(job, llm, messages: list[dict], index: int, reply_tokens: int) -> Job:
    req = ChatCompletionRequest(messages=messages, max_tokens=reply_tokens, temperature=0, ignore_eos=True)
    plan = chat_requests.plan(llm, req)
    return job(req, messages=plan.messages, session=f"{SESSION_PREFIX}{index}", rendered=plan.rendered)


def _completion(prompt: list[int], reply_tokens: int) -> CompletionRequest:
    return CompletionRequest(prompt=prompt, max_tokens=reply_tokens, temperature=0, ignore_eos=True)


def _text(tokenizer, seed: int, tokens: int) -> str:
    """About `tokens` tokens of numbers that differ from the first word on between seeds (so that no
    conversation takes another's KV from the prefix index)."""
    words = [str((seed * 7919 + j * 104729) % 100003) for j in range(tokens)]
    per_word = max(1, len(tokenizer.encode(" ".join(words[:64]), add_special_tokens=False)) / 64)
    return f"warm-up {seed}: " + " ".join(words[: max(1, int(tokens / per_word))])


def _count(counter) -> float:
    return sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))
