"""Named settings of `turnkv bench quality --preset NAME`: the subsets the project runs itself.

- `smoke`: the subset CI runs (tests/bench/test_quality_smoke.py): every task and question position,
  SnapKV under both turn policies against the full cache, short contexts and answers, with the
  embedded SmolLM2; it checks the machinery, not the method ranking.
- `full`: the committed SmolLM2-135M run (benchmarks/quality/results/smollm2-hour, made by
  benchmarks/quality/run_smollm2.sh): every task and position, 3 turns, the core recipes under
  recompress and flowkv at keep_ratio 0.2 and 0.5, the other evicting presets at both under
  recompress, and every preset that does not evict at two sizes scaled to the run's length (below),
  in 2 worker processes.

A preset only fills in defaults: any flag given on the command line wins.
"""

from __future__ import annotations

ALL_TASKS = "needle_qa,kv_retrieval,preferences,instructions,fewshot"

# The defaults of every flag a preset may set (what the command uses with no preset).
DEFAULTS = {
    "tasks": ALL_TASKS, "recipes": "snapkv,ada-snapkv", "policies": "recompress", "budget": None,
    "keep_ratio": None, "positions": "begin,middle,end", "turns": 3, "n": 2, "context_tokens": 300,
    "difficulty": 1, "seed": 0, "max_new_tokens": 48, "out": "benchmarks/quality/results/latest", "workers": 1, "batch": 16,
    "kv_memory": None,
}

CORE_RECIPES = "streaming-llm,h2o,snapkv,ada-snapkv"
# The other evicting presets, under recompress only (the core ones run under both policies).
# flowkv and flowkv-ada-snapkv are absent: they are snapkv / ada-snapkv under the flowkv policy.
OTHER_EVICTING = ("pyramidkv", "tova", "knorm", "expected-attention", "random", "ada-pyramidkv",
                  "ada-expected-attention")

# The presets that do not evict, at two sizes scaled to the run's length. Their defaults are sized
# for long prompts (A-shape's 4096 local keys, Quest's 4096-token selection, LoopServe's B = 1024):
# on 3 turns of about 370 tokens (a history of about 1130 tokens at the third turn) most of them
# would read every key and equal the full cache. Each gets 256 and 512 tokens per head, about 0.2
# and 0.5 of the third turn's history, like keep_ratio 0.2 / 0.5 of the evicting ones:
# - decode selection (quest, lserve-dynamic, loopserve-d, the decode half of loopserve and lserve):
#   its token budget (LServe's must be a multiple of its 64-token pages);
# - static windows (a-shape, tri-shape, duo-attention, lserve's streaming heads): sink + local, in
#   the ratio of their defaults (1 : 3); tri-shape keeps its last quarter of that dense (64 / 128 rows);
# - minference: vertical + slash lines, split the same way;
# - loopserve-p has no size: alpha, the attention mass its lines must recover, is its knob (0.9 and
#   the default 0.955).
# lserve-static is absent: it is the same recipe as duo-attention (prefill=streaming_heads).
SCALED = {
    256: {"sink": 64, "local": 192, "last": 64},
    512: {"sink": 128, "local": 384, "last": 128},
}


def scaled_recipes() -> list[str]:
    """"LABEL: SPEC" items for the non-evicting presets at the scaled sizes (see SCALED)."""
    items = []
    for size, w in SCALED.items():
        window = f"sink={w['sink']}, local={w['local']}"
        items += [
            f"quest@{size}: quest decode=quest(budget={size})",
            f"lserve-dynamic@{size}: lserve-dynamic decode=lserve(budget={size})",
            f"loopserve-d@{size}: loopserve-d decode=loopserve(budget={size})",
            f"loopserve@{size}: loopserve decode=loopserve(budget={size})",
            f"duo-attention@{size}: duo-attention prefill=streaming_heads({window})",
            f"lserve@{size}: lserve prefill=streaming_heads({window}) decode=lserve(budget={size})",
            f"a-shape@{size}: a-shape prefill=a_shape({window})",
            f"tri-shape@{size}: tri-shape prefill=tri_shape({window}, last={w['last']})",
            f"minference@{size}: minference prefill=minference(vertical={w['sink']}, slash={w['local']})",
        ]
    items += ["loopserve-p@alpha0.9: loopserve-p prefill=loopserve(alpha=0.9)", "loopserve-p@alpha0.955: loopserve-p"]
    return items


FULL_RECIPES = ",".join([CORE_RECIPES, *(f"{name}: {name} turns=recompress" for name in OTHER_EVICTING),
                         *scaled_recipes()])

PRESETS = {
    "smoke": {"tasks": ALL_TASKS, "recipes": "snapkv", "policies": "recompress,flowkv", "budget": 32,
              "keep_ratio": None, "positions": "begin,middle,end", "turns": 2, "n": 1, "context_tokens": 120,
              "difficulty": 1, "seed": 0, "max_new_tokens": 8, "out": "benchmarks/quality/smoke"},
    "full": {"tasks": ALL_TASKS, "recipes": FULL_RECIPES, "policies": "recompress,flowkv",
             "budget": None, "keep_ratio": "0.2,0.5", "positions": "begin,middle,end", "turns": 3, "n": 1,
             "context_tokens": 300, "difficulty": 1, "seed": 0, "max_new_tokens": 48,
             "out": "benchmarks/quality/results/smollm2-hour", "workers": 2, "batch": 16, "kv_memory": "2560MiB"},
}


def apply(args) -> None:
    """Fill every flag left unset (None) on `args` from its preset, else from DEFAULTS."""
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    values = DEFAULTS | PRESETS.get(args.preset, {})
    if args.budget is not None or args.keep_ratio is not None:  # an amount given by hand replaces the preset's
        values = {k: v for k, v in values.items() if k not in ("budget", "keep_ratio")}
    for key, value in values.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
