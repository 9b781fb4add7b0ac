"""The scoreboard's measurements, each on the one engine the run builds and each through a path users take:

- speed(llm, spec, ctx, ...): `turnkv bench speed`'s measure() (LLM.generate of a ctx-token prompt):
  TTFT, steady time per decode token, KV bytes held at the end.
- later_turn(llm, spec, history, ...): a chat whose first turn is a `history`-token message, then turns of
  `turn_tokens` tokens through Conversation.send; each turn's TTFT (Reply.ttft_s) over the kept history.
- restore(llm, n, ...): benchmarks/state/gpu_state_restore.py's row: an n-token conversation offloaded to
  the CPU tier and its returning turn's TTFT, per state strategy.

Each returns a row (a dict of JSON values); a row that could not be measured holds "unavailable" and why.
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from turnkv.bench.speed import SpeedConfig, measure
from turnkv.errors import KVCacheFullError
from turnkv.methods.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))
import gpu_state_restore  # noqa: E402  (the Krul benchmark: its messages, history and returning turn)

WARMUP_TURNS = 2  # untimed later turns: Triton compiles once for lengths divisible by 16, once for the others


def _guarded(fn) -> dict:
    """fn()'s row, or {"unavailable": why} when the engine's pool or the device ran out."""
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"unavailable": f"out of memory: {str(e).splitlines()[0]}"}
    except KVCacheFullError as e:
        return {"unavailable": f"KV pool full: {e}"}


def speed(llm, spec: str, ctx: int, cfg: SpeedConfig, hw: dict) -> dict:
    """TTFT, ms per token and KV of one `ctx`-token prompt under recipe `spec`, batch 1 (speed.measure)."""
    return _guarded(lambda: {"recipe": spec, "context": ctx, **measure(llm, Recipe.parse(spec), ctx, 1, cfg, hw)})


class Messages:
    """Chat messages of known token counts (the Krul benchmark's Words) and what the chat template adds
    to a first and a later turn; None where the engine has no tokenizer."""

    def __init__(self, llm):
        self.words = gpu_state_restore.Words(llm.tokenizer, llm.config.vocab_size)
        self.first, self.later = gpu_state_restore.template_overheads(llm, self.words)


def later_turn_history(max_model_len: int, history: int, turn_tokens: int, repeat: int, later: int) -> int:
    """The longest kept history, at most `history`, after which WARMUP_TURNS + repeat turns of
    `turn_tokens` tokens (each with its one reply token and the template's `later` tokens) still fit."""
    return min(history, max_model_len - (WARMUP_TURNS + repeat) * (turn_tokens + later + 1) - 8)


def later_turn(llm, spec: str, history: int, turn_tokens: int, repeat: int, messages: Messages) -> dict:
    """A conversation under recipe `spec` holding a `history`-token first turn, then WARMUP_TURNS untimed
    and `repeat` timed turns of about `turn_tokens` tokens, each a token shorter than the last (a new
    length every call, as conversations have them). ttft_s: the median of the timed turns' Reply.ttft_s;
    history_tokens: what the conversation held when the first timed turn began."""

    def run():
        rng, words = random.Random(history), messages.words
        conv = llm.conversation(system=words.system, recipe=spec)
        try:
            first = conv.send(words.text(history - messages.first, rng), max_new_tokens=1, ignore_eos=True)
            held, times, prompts = None, [], []
            for i in range(WARMUP_TURNS + repeat):
                if i == WARMUP_TURNS:
                    held = conv.kv.next_position
                size = max(1, turn_tokens - messages.later - i)
                reply = conv.send(words.text(size, rng), max_new_tokens=1, ignore_eos=True)
                if i >= WARMUP_TURNS:
                    times.append(reply.ttft_s)
                    prompts.append(reply.prompt_tokens)
            return {"recipe": spec, "history_tokens": held, "prompt_tokens": prompts, "ttft_all": times,
                    "ttft_s": statistics.median(times), "first_turn_ttft_s": first.ttft_s,
                    "first_turn_tokens": first.prompt_tokens + first.cached_tokens}
        finally:
            conv.close()

    return _guarded(run)


def restore(llm, n: int, entry: str, repeat: int, messages: Messages) -> dict:
    """The Krul benchmark's row for state strategy `entry` ("label=spec" or a spec) at an n-token history:
    ttft_s (best of `repeat`) of the returning turn restored from the CPU tier, stored_bytes, fallback."""
    # The benchmark's turn sizes at a 32K history, shrunk for the short histories of a CPU run.
    args = SimpleNamespace(turn_prompt=min(256, n // 8), turn_decode=min(32, n // 16), history_turn=8192,
                           new_prompt=min(128, n // 8), repeats=repeat, skip_components=True)
    history = gpu_state_restore.History(n, args, messages.words, (messages.first, messages.later))
    row = gpu_state_restore.run_row(llm, n, args, entry, history)
    if "error" in row:
        return {"unavailable": row["error"], "strategy": row["strategy"]}
    return {k: row[k] for k in ("strategy", "spec", "history_tokens", "ttft_s", "ttft_all", "send_s", "stored_bytes",
                                "stored_share", "prompt_tokens") if k in row} | {"fallback": row.get("fallback")}
