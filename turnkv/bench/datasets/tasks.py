"""The synthetic tasks by name: seeded generators of multi-turn instances that need no download.

Knobs shared by every task:
- `turns`: turns per conversation;
- `context_tokens`: the approximate length of every turn's context, counted with `tokenizer` when
  given, else estimated at 0.75 words a token (about 300 suits a 135M model on CPU, several thousand
  an 8B one on GPU);
- `difficulty`: the task's own hardness dial (distractor facts, decoy keys, answer options, stacked
  instructions, label-set size; see each module).
Instance i of a seed is the same whatever n is, and every question sits at the end ("end");
Instance.with_position gives the begin and middle variants.
"""

from __future__ import annotations

from turnkv.bench.datasets import fewshot, instructions, kv_retrieval, needle_qa, preferences
from turnkv.bench.datasets.schema import Instance

TASKS = {
    "needle_qa": needle_qa.generate,
    "kv_retrieval": kv_retrieval.generate,
    "preferences": preferences.generate,
    "instructions": instructions.generate,
    "fewshot": fewshot.generate,
}


def generate(task: str, n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None, **options) -> list[Instance]:
    """`n` instances of `task`; `options` go to the task's generator (kv_retrieval: style; preferences:
    scenario, pref_turn)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if turns < 1 or n < 0 or context_tokens < 0 or difficulty < 0:
        raise ValueError("turns must be positive, and n, context_tokens and difficulty not negative")
    return TASKS[task](n, seed=seed, turns=turns, context_tokens=context_tokens, difficulty=difficulty,
                       tokenizer=tokenizer, **options)
