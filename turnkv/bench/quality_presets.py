"""Named settings of `turnkv bench quality --preset NAME`: the subsets the project runs itself.

- `smoke`: the subset CI runs (tests/bench/test_quality_smoke.py): every task and question position,
  SnapKV under both turn policies against the full cache, short contexts and answers. About two
  minutes on 2 CPU cores with the embedded SmolLM2; it checks the machinery, not the method ranking.
- `full`: the committed SmolLM2-135M run (benchmarks/quality/smollm2-full): every task and position,
  the core recipes under recompress and flowkv at two budgets, then every other preset.
  benchmarks/quality/run_smollm2_full.sh runs it in stages so that a stopped run leaves whole slices.

A preset only fills in defaults: any flag given on the command line wins.
"""

from __future__ import annotations

ALL_TASKS = "needle_qa,kv_retrieval,preferences,instructions,fewshot"

# The defaults of every flag a preset may set (what the command uses with no preset).
DEFAULTS = {
    "tasks": ALL_TASKS, "recipes": "snapkv,ada-snapkv", "policies": "recompress", "budget": None,
    "keep_ratio": None, "positions": "begin,middle,end", "turns": 3, "n": 2, "context_tokens": 300,
    "difficulty": 1, "seed": 0, "max_new_tokens": 48, "out": "benchmarks/quality/latest",
}

CORE_RECIPES = "streaming-llm,h2o,snapkv,ada-snapkv"
# flowkv and flowkv-ada-snapkv are absent: they are snapkv / ada-snapkv under the flowkv policy.
# a-shape, tri-shape, minference and loopserve-d are absent too: at the full preset's lengths their
# defaults cover every key, so they equal the full cache (benchmarks/loopserve_cpu.sh runs them at 4K).
OTHER_RECIPES = ("pyramidkv,tova,knorm,expected-attention,random,ada-pyramidkv,ada-expected-attention,"
                 "loopserve-p,loopserve")

PRESETS = {
    "smoke": {"tasks": ALL_TASKS, "recipes": "snapkv", "policies": "recompress,flowkv", "budget": 32,
              "keep_ratio": None, "positions": "begin,middle,end", "turns": 2, "n": 1, "context_tokens": 120,
              "difficulty": 1, "seed": 0, "max_new_tokens": 8, "out": "benchmarks/quality/smoke"},
    "full": {"tasks": ALL_TASKS, "recipes": f"{CORE_RECIPES},{OTHER_RECIPES}", "policies": "recompress,flowkv",
             "budget": None, "keep_ratio": "0.2,0.5", "positions": "begin,middle,end", "turns": 3, "n": 1,
             "context_tokens": 300, "difficulty": 1, "seed": 0, "max_new_tokens": 48,
             "out": "benchmarks/quality/smollm2-full"},
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
