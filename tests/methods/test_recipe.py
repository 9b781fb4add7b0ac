"""Recipes: built as dataclasses, from strings, presets and JSON/YAML files; printed recipes parse back
to equal ones; bad input fails with an InvalidRequestError that says what exists."""

from __future__ import annotations

import dataclasses
import json

import pytest

from turnkv.errors import InvalidRequestError
from turnkv.methods import registry
from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.eviction import SCHEDULES, Eviction
from turnkv.methods.evict.snapkv import SnapKVScorer
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.recipe import DEFAULT_BUDGET, PRESET_DOCS, Recipe, preset, presets
from turnkv.methods.turns.flowkv import FlowKVTurns
from turnkv.methods.turns.recompress import RecompressTurns

SCORERS = ["expected_attention", "h2o", "knorm", "pyramidkv", "random", "snapkv", "streaming_llm", "tova"]
ALLOCATORS = ["adakv", "uniform"]
TURNS = ["flowkv", "recompress"]


# ---- construction -----------------------------------------------------------------------------------
def test_dataclass_recipe_equals_the_string_recipe():
    built = Recipe(evict=Eviction(scorer=SnapKVScorer(window=16), allocator=AdaKVAllocator(alpha=0.3), budget=256),
                   turns=FlowKVTurns())
    parsed = Recipe.parse("evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 turns=flowkv")
    assert parsed == built
    e = parsed.evict
    assert (e.scorer.window, e.scorer.kernel, e.scorer.pooling) == (16, 5, "avg")
    assert (e.allocator.alpha, e.allocator.rule) == (0.3, "code")
    assert (e.budget, e.keep_ratio, e.schedule, e.every) == (256, None, "prefill", 64)
    assert (parsed.turns.min_size, parsed.turns.reading) == (32, "segment")
    # The default recipe is the full cache, and so is the empty string.
    assert Recipe() == Recipe.parse("") == Recipe.parse("   ") == preset("full")
    assert Recipe().evict is None and Recipe().turns == RecompressTurns()


def test_eviction_parameters_may_sit_inside_the_terms_and_separators_vary():
    a = Recipe.parse("evict=snapkv(window=8,budget=12,schedule=turn_end)+adakv(alpha=0.5) turns=flowkv(min_size=4)")
    b = Recipe.parse("evict=snapkv(window=8)+adakv(alpha=0.5);budget=12,schedule=turn_end turns=flowkv(min_size=4)")
    assert a == b
    e = a.evict
    assert (e.budget, e.schedule, e.scorer.window, e.allocator.alpha) == (12, "turn_end", 8, 0.5)
    assert a.turns == FlowKVTurns(min_size=4)
    # Names take dashes or underscores.
    assert Recipe.parse("evict=streaming-llm budget=5").evict.scorer.name == "streaming_llm"


def test_preset_then_overrides():
    r = Recipe.parse("ada-snapkv budget=64")
    assert r.evict == Eviction(scorer=SnapKVScorer(kernel=7, pooling="max"), allocator=AdaKVAllocator(),
                               budget=64)
    assert r.turns == RecompressTurns()
    # A preset alone gets the default budget.
    assert preset("ada-snapkv").evict.budget == DEFAULT_BUDGET == 1024
    # keep_ratio replaces the preset's budget (exactly one of the two stays).
    r = Recipe.parse("flowkv-ada-snapkv keep_ratio=0.4 schedule=turn_end")
    assert (r.evict.budget, r.evict.keep_ratio, r.evict.schedule) == (None, 0.4, "turn_end")
    assert r.turns == FlowKVTurns() and isinstance(r.evict.allocator, AdaKVAllocator)
    # A later evict= replaces the preset's eviction, and the amount applies to the new one.
    r = Recipe.parse("ada-snapkv evict=knorm budget=8")
    assert (r.evict.scorer.name, type(r.evict.allocator), r.evict.budget) == ("knorm", UniformAllocator, 8)
    # A later preset replaces an earlier one.
    assert Recipe.parse("snapkv ada-snapkv") == preset("ada-snapkv")


@pytest.mark.parametrize("text", ["snapkv compression_ratio=0.75", "evict=snapkv compression_ratio=0.75",
                                  "evict=snapkv(compression_ratio=0.75)"])
def test_compression_ratio_is_the_fraction_removed(text):
    e = Recipe.parse(text).evict
    assert e.keep_ratio == 0.25 and e.budget is None
    # kvpress's convention: 0.3 removed keeps 0.7 (up to float rounding of 1 - r).
    assert Recipe.parse("snapkv compression_ratio=0.3").evict.keep_ratio == pytest.approx(0.7, abs=1e-12)
    assert Recipe.parse("snapkv compression_ratio=0").evict.keep_ratio == 1.0


def test_from_file_json_and_yaml(tmp_path):
    expected = Recipe.parse("evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 turns=flowkv")
    block = {"scorer": "snapkv", "window": 16, "allocator": "adakv", "alpha": 0.3, "budget": 256}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"evict": block, "turns": "flowkv"}))
    assert Recipe.from_file(path) == expected
    path.write_text(json.dumps({"evict": "snapkv(window=16)+adakv(alpha=0.3)", "budget": 256,
                                "turns": {"name": "flowkv"}}))
    assert Recipe.from_file(str(path)) == expected

    yml = tmp_path / "r.yaml"
    yml.write_text("evict:\n  scorer: snapkv\n  window: 16\n  allocator: adakv\n  alpha: 0.3\n"
                   "budget: 256\nturns:\n  name: flowkv\n  min_size: 8\n  reading: query\n")
    r = Recipe.from_file(yml)
    assert r == Recipe.parse("evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 "
                             "turns=flowkv(min_size=8,reading=query)")
    assert (r.turns.min_size, r.turns.reading) == (8, "query")

    yml2 = tmp_path / "p.yml"
    yml2.write_text("preset: ada-snapkv\nbudget: 64\nschedule: turn_end\n")
    assert Recipe.from_file(yml2) == Recipe.parse("ada-snapkv budget=64 schedule=turn_end")

    naive = tmp_path / "n.json"
    naive.write_text(json.dumps({"evict": "snapkv", "compression_ratio": 0.75,
                                 "turns": {"name": "recompress", "budget_rule": "naive"}}))
    r = Recipe.from_file(naive)
    assert (r.evict.keep_ratio, r.turns.budget_rule) == (0.25, "naive")


def test_from_file_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read the recipe file"):
        Recipe.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        Recipe.from_file(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- snapkv\n- adakv\n")
    with pytest.raises(InvalidRequestError, match="mapping"):
        Recipe.from_file(listed)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"preset": "nope"}))
    with pytest.raises(InvalidRequestError, match="presets: full"):
        Recipe.from_file(unknown)
    flow_decode = tmp_path / "fd.yaml"
    flow_decode.write_text("evict: snapkv\nbudget: 8\nturns: flowkv\nschedule: decode\n")
    with pytest.raises(InvalidRequestError, match="flowkv keeps the running turn whole"):
        Recipe.from_file(flow_decode)


def test_yaml_syntax_error_is_an_invalid_request(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("evict: [unclosed\n")
    with pytest.raises(InvalidRequestError):
        Recipe.from_file(path)


def test_null_evict_in_a_file_means_no_eviction(tmp_path):
    path = tmp_path / "null.json"
    path.write_text(json.dumps({"evict": None}))
    assert Recipe.from_file(path) == Recipe()


# ---- printing and round trips -----------------------------------------------------------------------
ROUND_TRIPS = [
    "evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 turns=flowkv",
    "ada-snapkv budget=64",
    "snapkv compression_ratio=0.75",
    "snapkv compression_ratio=0.7",
    ("evict=snapkv(window=16,pooling=avg)+adakv(rule=kvpress) keep_ratio=0.3 schedule=turn_end "
     "turns=recompress(budget_rule=naive)"),
    "snapkv budget=8 schedule=decode every=5",
    "turns=flowkv(reading=query,min_size=4) evict=h2o(recent_ratio=0.25) budget=8",
    "evict=pyramidkv(beta=4)+adakv(alpha=0.5,rule=paper) budget=32 schedule=context",
    "evict=expected_attention(use_covariance=false,future=64) budget=9",
    "evict=random(seed=3) budget=5",
    "full",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_str_round_trips(text):
    recipe = Recipe.parse(text)
    printed = str(recipe)
    again = Recipe.parse(printed)
    assert again == recipe
    assert str(again) == printed
    # Every axis is spelled out.
    for axis in ("prefill=", "evict=", "turns=", "decode=", "state="):
        assert axis in printed


def test_str_spells_out_the_eviction():
    r = Recipe.parse("evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 turns=flowkv(min_size=8)")
    assert str(r) == ("prefill=dense evict=snapkv(window=16)+adakv(alpha=0.3) budget=256 schedule=prefill "
                      "turns=flowkv(min_size=8) decode=all state=gpu")
    assert str(Recipe.parse("snapkv compression_ratio=0.75 schedule=decode every=3")) == (
        "prefill=dense evict=snapkv+uniform keep_ratio=0.25 schedule=decode every=3 "
        "turns=recompress decode=all state=gpu")
    assert str(Recipe()) == "prefill=dense evict=none turns=recompress decode=all state=gpu"


def test_str_round_trips_every_on_other_schedules():
    recipe = Recipe.parse("snapkv budget=8 every=10")
    assert recipe.evict.every == 10
    assert Recipe.parse(str(recipe)) == recipe


def test_every_preset_builds():
    table = presets()
    assert list(table) == list(PRESET_DOCS)
    assert len(table) == 26
    # The prefill-pattern and decode-selection presets: (prefill, decode) per name, nothing evicted.
    patterns = {"loopserve": ("loopserve", "loopserve"), "loopserve-p": ("loopserve", "all"),
                "loopserve-d": ("dense", "loopserve"), "a-shape": ("a_shape", "all"),
                "tri-shape": ("tri_shape", "all"), "minference": ("minference", "all"),
                "quest": ("dense", "quest"), "duo-attention": ("streaming_heads", "all"),
                "lserve": ("streaming_heads", "lserve"), "lserve-random": ("streaming_heads", "lserve"),
                "lserve-static": ("streaming_heads", "all"),
                "lserve-dynamic": ("dense", "lserve")}
    scorers = {"streaming-llm": "streaming_llm", "h2o": "h2o", "snapkv": "snapkv", "pyramidkv": "pyramidkv",
               "tova": "tova", "knorm": "knorm", "expected-attention": "expected_attention", "random": "random",
               "ada-snapkv": "snapkv", "ada-pyramidkv": "pyramidkv", "ada-expected-attention": "expected_attention",
               "flowkv": "snapkv", "flowkv-ada-snapkv": "snapkv"}
    for name, recipe in table.items():
        assert isinstance(recipe, Recipe)
        assert preset(name) == recipe == Recipe.parse(name) == Recipe.parse(str(recipe))
        if name == "full":
            assert recipe.evict is None
            continue
        if name in patterns:
            assert (recipe.prefill.name, recipe.decode.name, recipe.evict) == (*patterns[name], None)
            # They combine with the eviction axis.
            assert Recipe.parse(f"{name} evict=snapkv budget=24").evict.budget == 24
            continue
        assert (recipe.prefill.name, recipe.decode.name) == ("dense", "all")
        e = recipe.evict
        assert e.scorer.name == scorers[name]
        assert type(e.allocator) is (AdaKVAllocator if "ada-" in name else UniformAllocator)
        assert (e.budget, e.keep_ratio, e.schedule) == (DEFAULT_BUDGET, None, "prefill")
        assert recipe.turns.name == ("flowkv" if name.startswith("flowkv") else "recompress")
        # Any preset takes a budget override.
        assert Recipe.parse(f"{name} budget=24").evict.budget == 24


# ---- errors -----------------------------------------------------------------------------------------
ERRORS = [
    ("nope", ["unknown recipe 'nope'", *PRESET_DOCS]),
    ("snapkv foo=1", ["unknown recipe key 'foo'", "prefill, evict, turns, decode, state",
                      "budget, compression_ratio, every, keep_ratio, schedule"]),
    ("evict=nope", ["unknown scorer 'nope'", ", ".join(SCORERS)]),
    ("evict=adakv", ["unknown scorer 'adakv'", ", ".join(SCORERS)]),
    ("evict=snapkv+pyramidkv", ["unknown allocator 'pyramidkv'", "adakv, uniform"]),
    ("snapkv turns=bogus", ["unknown turns 'bogus'", "flowkv, recompress"]),
    ("prefill=sparse", ["unknown prefill 'sparse'", "dense"]),
    ("decode=topk", ["unknown decode 'topk'", "all"]),
    ("state=cpu", ["unknown state 'cpu'", "gpu"]),
    ("evict=snapkv(windw=3)", ["no parameter 'windw'", "its parameters: compat, kernel, pooling, window"]),
    ("evict=snapkv+adakv(beta=1)", ["no parameter 'beta'", "its parameters: alpha, rule"]),
    ("evict=knorm(window=4)", ["scorer 'knorm' has no parameter 'window'", "its parameters: compat"]),
    ("snapkv turns=flowkv(size=3)", ["no parameter 'size'", "its parameters: min_size, reading, system"]),
    ("evict=snapkv(window)", ["parameter 'window' of snapkv needs the form key=value"]),
    ("snapkv budget=-1", ["budget must be an integer >= 1"]),
    ("snapkv budget=0", ["budget must be an integer >= 1"]),
    ("snapkv keep_ratio=2", ["keep_ratio must be a number in (0, 1]"]),
    ("snapkv keep_ratio=0", ["keep_ratio must be a number in (0, 1]"]),
    ("snapkv keep_ratio=nan", ["keep_ratio must be a number in (0, 1]"]),
    ("snapkv compression_ratio=1", ["compression_ratio must be a number in [0, 1)"]),
    ("snapkv schedule=bogus", ["schedule must be one of " + ", ".join(SCHEDULES)]),
    ("snapkv schedule=decode every=0", ["every must be an integer >= 1"]),
    ("evict=snapkv+adakv(alpha=3)", ["allocator 'adakv'", "alpha must be in [0, 1]"]),
    ("evict=snapkv+adakv(rule=magic)", ["rule must be one of code, paper, kvpress"]),
    ("evict=snapkv(kernel=4)", ["kernel a positive odd number"]),
    ("evict=h2o(recent_ratio=1.5)", ["recent_ratio must be in [0, 1]"]),
    ("snapkv turns=flowkv(reading=x)", ["reading must be 'segment' or 'query'"]),
    ("snapkv turns=flowkv(system=x)", ["system must be 'next_query' or 'own'"]),
    ("snapkv turns=flowkv(min_size=-1)", ["min_size must be >= 0"]),
    ("snapkv turns=recompress(budget_rule=greedy)", ["budget_rule must be 'matched' or 'naive'"]),
    ("evict=snapkv+adakv+uniform", ["evict='snapkv+adakv+uniform'", "scorer(...)+allocator(...)"]),
    ("snapkv budget=8 keep_ratio=0.5", ["exactly one of budget", "keep_ratio"]),
    ("budget=8", ["budget sets how much an eviction method keeps, and this recipe evicts nothing",
                  "evict=...", "turnkv methods --presets"]),
    ("compression_ratio=0.75", ["compression_ratio sets how much an eviction method keeps"]),
    ("evict=none keep_ratio=0.5", ["keep_ratio sets how much an eviction method keeps"]),
    # A value out of range is named as such, with or without an eviction method to take it.
    ("budget=-5", ["budget must be an integer >= 1"]),
    ("keep_ratio=1.5", ["keep_ratio must be a number in (0, 1]"]),
    ("snapkv(", ["unbalanced parentheses"]),
]


@pytest.mark.parametrize("text,parts", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_say_what_exists(text, parts):
    with pytest.raises(InvalidRequestError) as info:
        Recipe.parse(text)
    assert isinstance(info.value, ValueError)
    for part in parts:
        assert part in str(info.value)


def test_unknown_preset_lists_every_preset():
    with pytest.raises(InvalidRequestError) as info:
        preset("snap-kv")
    assert str(info.value) == "unknown recipe 'snap-kv'; presets: " + ", ".join(PRESET_DOCS)


@pytest.mark.parametrize("text", ["snapkv budget=true", "snapkv budget=2.5", "snapkv schedule=decode every=2.5"])
def test_non_integer_amounts_are_rejected(text):
    with pytest.raises(InvalidRequestError):
        Recipe.parse(text)


def test_decode_schedule_with_flowkv_is_rejected():
    message = "flowkv keeps the running turn whole"
    for text in ["snapkv budget=8 schedule=decode turns=flowkv", "flowkv schedule=decode",
                 "turns=flowkv snapkv schedule=decode every=4",
                 "evict=snapkv(schedule=decode,budget=8) turns=flowkv", "flowkv-ada-snapkv schedule=decode"]:
        with pytest.raises(InvalidRequestError, match=message):
            Recipe.parse(text)
    with pytest.raises(InvalidRequestError, match=message):
        Recipe(evict=Eviction(scorer=SnapKVScorer(), budget=8, schedule="decode"), turns=FlowKVTurns())
    with pytest.raises(InvalidRequestError, match=message):
        Recipe.from_dict({"evict": {"scorer": "snapkv", "schedule": "decode"}, "turns": "flowkv"})
    # The other schedules go with flowkv, and decode goes with recompress.
    for schedule in ("prefill", "context", "turn_end"):
        assert Recipe.parse(f"flowkv schedule={schedule}").evict.schedule == schedule
    assert Recipe.parse("snapkv schedule=decode every=4").evict.every == 4


# ---- the registry -----------------------------------------------------------------------------------
def test_describe_lists_every_component_with_its_defaults():
    rows = registry.describe()
    by_kind = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row["name"])
        assert row["doc"], row
        assert row["axis"] == registry.KINDS[row["kind"]][0]
    assert list(by_kind) == list(registry.KINDS)
    assert list(dict.fromkeys(row["axis"] for row in rows)) == list(registry.AXES)
    assert by_kind == {"prefill": ["a_shape", "dense", "loopserve", "minference", "streaming_heads", "tri_shape"], "scorer": SCORERS,
                       "allocator": ALLOCATORS, "turns": TURNS, "decode": ["all", "loopserve", "lserve", "quest"], "state": ["gpu", "krul", "krul_fix", "load", "minicache", "partial", "recompute",
                                                                                                                    "resident"]}
    params = {(r["kind"], r["name"]): r["params"] for r in rows}
    assert params[("decode", "loopserve")] == {"budget": 1024, "interval": 16, "warmup": 16, "window": None,
                                               "granularity": "query", "sinks": 0}
    assert params[("prefill", "a_shape")] == {"sink": 128, "local": 4096}
    assert params[("prefill", "streaming_heads")] == {"pattern": None, "ratio": None, "sink": 128, "local": 256,
                                                      "prefill_local": 8192, "dense": None}
    assert params[("decode", "lserve")] == {"budget": 4096, "physical_page": 64, "logical_page": 16, "reuse": 4,
                                            "group": "query"}
    assert params[("prefill", "loopserve")]["alpha"] == 0.955 and params[("prefill", "loopserve")]["samples"] == 48
    assert params[("scorer", "snapkv")] == {"window": 32, "kernel": 5, "pooling": "avg", "compat": "authors"}
    assert params[("scorer", "pyramidkv")] == {"window": 32, "kernel": 5, "pooling": "avg", "compat": "authors",
                                               "beta": 20}
    assert params[("scorer", "expected_attention")] == {"queries": "all", "window": 64, "future": 512, "sinks": 4,
                                                        "use_covariance": True, "use_vnorm": True, "epsilon": 0.0,
                                                        "compat": "authors"}
    assert params[("scorer", "h2o")] == {"recent_ratio": 0.5}
    assert params[("scorer", "streaming_llm")] == {"sinks": 4, "compat": "authors"}
    assert params[("scorer", "tova")] == {"window": 1, "group": "layer", "compat": "authors"}
    assert params[("scorer", "random")] == {"seed": 0}
    assert params[("scorer", "knorm")] == {"compat": "authors"}
    assert params[("allocator", "adakv")] == {"alpha": 0.2, "rule": "code"}
    assert params[("allocator", "uniform")] == {}
    assert params[("turns", "flowkv")] == {"min_size": 32, "reading": "segment", "system": "next_query"}
    assert params[("turns", "recompress")] == {"budget_rule": "matched"}
    # Each described component builds with no arguments, and its fields default to what describe says.
    for row in rows:
        component = registry.build(row["kind"], row["name"], {})
        assert component.name == row["name"]
        assert {f.name: getattr(component, f.name) for f in dataclasses.fields(component) if f.init} == row["params"]
        # ...and with every parameter given explicitly at its default.
        assert registry.build(row["kind"], row["name"], dict(row["params"])) == component


def test_build_errors_list_the_options():
    with pytest.raises(InvalidRequestError, match="choose one of: adakv, uniform"):
        registry.build("allocator", "ada")
    with pytest.raises(InvalidRequestError, match="its parameters: min_size, reading, system"):
        registry.build("turns", "flowkv", {"min": 3})
    with pytest.raises(InvalidRequestError, match="turns 'flowkv': min_size must be >= 0"):
        registry.build("turns", "flowkv", {"min_size": -2})


@pytest.mark.parametrize("text, compresses", [
    ("ada-snapkv schedule=prompt", True), ("snapkv", True), ("snapkv schedule=turn_end", False),
    ("snapkv schedule=decode", False), ("full", False), ("lserve", False),
])
def test_a_recipe_says_whether_a_prompt_ends_in_an_eviction_pass(text, compresses):
    recipe = Recipe.of(text)
    assert recipe.compresses_after_prompt is compresses
    assert (recipe.evict is not None and recipe.evict.schedule in ("prefill", "prompt")) is compresses
