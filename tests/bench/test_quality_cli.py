"""`turnkv bench quality` flags: presets fill defaults without overriding what is given, and turn
policies cross only the recipes that do not name their own."""

from __future__ import annotations

import argparse

import pytest

from turnkv.bench.cli import add_quality_parser, expand_recipes
from turnkv.bench.quality_presets import PRESETS, apply


def parse(argv):
    parser = argparse.ArgumentParser()
    add_quality_parser(parser.add_subparsers())
    args = parser.parse_args(["quality", *argv])
    apply(args)
    return args


def test_no_preset_gives_the_documented_defaults():
    args = parse([])
    assert (args.recipes, args.policies, args.n, args.turns, args.max_new_tokens) == ("snapkv,ada-snapkv", "recompress",
                                                                                      2, 3, 48)
    assert args.budget is None and args.keep_ratio is None


def test_a_preset_fills_defaults_and_explicit_flags_win():
    args = parse(["--preset", "smoke", "--n", "3"])
    assert args.n == 3 and args.recipes == PRESETS["smoke"]["recipes"] and args.budget == PRESETS["smoke"]["budget"]
    # an amount given by hand replaces the preset's rather than clashing with it
    args = parse(["--preset", "smoke", "--keep-ratio", "0.5"])
    assert args.budget is None and args.keep_ratio == "0.5"
    with pytest.raises(ValueError, match="unknown preset"):
        parse(["--preset", "nope"])


def test_full_preset_runs_the_core_recipes_under_both_policies_at_two_ratios():
    full = parse(["--preset", "full"])
    recipes = expand_recipes(full)
    for core in ("streaming-llm", "h2o", "snapkv", "ada-snapkv"):
        for policy in ("recompress", "flowkv"):
            assert {f"{core}@{policy}@0.2", f"{core}@{policy}@0.5"} <= set(recipes)
    assert full.positions == "begin,middle,end" and len(full.tasks.split(",")) == 5 and full.max_new_tokens >= 48


def test_full_preset_runs_every_preset_at_two_sizes():
    # "...and the other presets that exist when you run it": a preset added later fails here until
    # the full preset runs it (or names why not).
    from turnkv.methods.recipe import presets

    recipes = expand_recipes(parse(["--preset", "full"]))
    same_as = {"flowkv": "snapkv@flowkv@0.2", "flowkv-ada-snapkv": "ada-snapkv@flowkv@0.2",
               "lserve-static": "duo-attention"}
    # Not run, and why: lserve-random is lserve with a random head pattern, for models without a
    # calibrated one; SmolLM2 has its own, which the lserve rows use.
    not_run = {"lserve-random"}
    for name, recipe in presets().items():
        if name == "full" or name in not_run:
            continue
        if name in same_as:  # the same recipe as another preset, run under that one's label
            other = presets()[same_as[name]] if name == "lserve-static" else recipes[same_as[name]]
            if recipe.evict is not None:
                recipe = recipe.with_overrides({"keep_ratio": "0.2"})
            assert str(recipe) == str(other), name
            continue
        settings = [label for label in recipes if label.split("@")[0] == name]
        assert len(settings) >= 2, name
        if recipe.evict is None and name != "loopserve-p":  # sized for these lengths, not the defaults
            assert all(str(recipes[label]) != str(recipe) for label in settings), name


def test_labelled_recipes_keep_their_label_and_cross_with_budgets():
    args = parse(["--recipes", "a-shape@64: prefill=a_shape(sink=16, local=48),tova: tova turns=recompress",
                  "--policies", "recompress,flowkv", "--keep-ratio", "0.2,0.5"])
    recipes = expand_recipes(args)
    assert set(recipes) == {"a-shape@64", "tova@0.2", "tova@0.5"}
    assert recipes["a-shape@64"].prefill.local == 48 and recipes["tova@0.5"].evict.keep_ratio == 0.5


def test_policies_do_not_override_a_recipe_that_names_its_own():
    args = parse(["--recipes", "flowkv,snapkv turns=flowkv,h2o,loopserve", "--policies", "recompress", "--budget", "16"])
    recipes = expand_recipes(args)
    assert recipes["flowkv"].turns.name == "flowkv" and recipes["snapkv turns=flowkv"].turns.name == "flowkv"
    assert recipes["h2o"].turns.name == "recompress" and recipes["h2o"].evict.budget == 16
    assert recipes["loopserve"].evict is None  # nothing to evict: no budget, no policy crossing


def test_a_lone_policy_other_than_the_default_is_in_the_label():
    # Two runs into one results file must never share a label: flowkv alone is named, recompress
    # alone (the default) is not, and several policies are always named.
    assert set(expand_recipes(parse(["--recipes", "h2o", "--policies", "flowkv"]))) == {"h2o@flowkv"}
    assert set(expand_recipes(parse(["--recipes", "h2o", "--policies", "recompress"]))) == {"h2o"}
    assert set(expand_recipes(parse(["--recipes", "h2o", "--policies", "recompress,flowkv", "--keep-ratio", "0.2"]))) \
        == {"h2o@recompress@0.2", "h2o@flowkv@0.2"}


def test_report_only_writes_the_report_of_a_partial_run_without_running(chat_model_dir, tmp_path):
    import json

    from turnkv.cli import main

    def record(recipe, score, kv):
        return {"instance": "i0-end", "task": "needle_qa", "position": "end", "recipe": recipe, "turn": 0,
                "score": score, "agreement": 1.0 if recipe == "full" else 0.5, "kl": 0.0 if recipe == "full" else 0.3,
                "kv_bytes": kv, "full_kv_bytes": 100}

    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in (record("full", 1.0, 100),
                                                                              record("snapkv", 0.0, 40))) + "\n")
    code = main(["bench", "quality", "--model", str(chat_model_dir), "--device", "cpu", "--kv-memory", "64MiB",
                 "--recipes", "snapkv", "--budget", "8", "--report-only", "--out", str(tmp_path)])
    assert code == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2  # nothing was run or appended
    by_recipe = {r["recipe"]: r for r in json.loads((tmp_path / "summary.json").read_text())["by_recipe"]}
    assert by_recipe["snapkv"]["kv_ratio"] == 0.4 and by_recipe["full"]["score"] == 1.0
