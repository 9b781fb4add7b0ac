"""The headline figures that the README and the docs quote, each computed from one committed JSON file.

A page quotes a figure between two HTML comments, which neither GitHub nor the site shows:

    <!--fig decode.full.128k.ms-->11.16<!--/fig-->

    python benchmarks/figures.py            # rewrite every quoted value from its JSON
    python benchmarks/figures.py --check    # list the quotes that disagree with their JSON; exit 1 if any
    python benchmarks/figures.py --list     # every figure: name, value, file

`tests/docs/test_figures.py` runs the check, so a page cannot quote a figure its JSON does not give.
A figure's value is a string: the number as the page prints it, with its unit where the page's
sentence needs one. A table figure is several lines, quoted with the markers on their own lines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
# The pages that quote figures: the README, every page of the site and the benchmark folders' READMEs.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmarks").glob("*/README.md"))]
# A figure's name is dotted lower case: topic.what[.detail].
QUOTE = re.compile(r"<!--fig ([a-z0-9_]+(?:\.[a-z0-9_-]+)+)-->(.*?)<!--/fig-->", re.DOTALL)

DECODE = "benchmarks/decode/results/h100-llama-3.1-8b-engine-path-eb30d5a/speed.json"
BATCH16 = "benchmarks/decode/results/h100-llama-3.1-8b-batch16/speed.json"
KV_QUANT = "benchmarks/decode/results/h100_kv_quant_engine_path.json"
CPU = "benchmarks/cpu/results/cpu_vs_transformers.json"
PREFIX = "benchmarks/prefix/results/h100_prefix_32k.json"
CAPACITY_ADA = "benchmarks/serving/results/capacity_h100_ada-snapkv_7312e7d/results.json"
CAPACITY_FULL = "benchmarks/serving/results/capacity_h100_full_7312e7d/results.json"
SERVE_H200 = "benchmarks/serving/results/serve_gpu_h200.json"
SERVE_CPU = "benchmarks/serving/results/serve_cpu.json"
STATE_GQA = "benchmarks/state/results/h100_state_restore_engine_path.json"
STATE_MHA = "benchmarks/state/results/h100_state_restore_mha_engine_path.json"
QUALITY = "benchmarks/quality/results/smollm2-hour/summary.json"
LOOPSERVE_QUALITY = "benchmarks/quality/results/loopserve-smollm2/summary.json"
EVICTION = "benchmarks/quality/results/eviction_multiturn.json"
KV_QUANT_FIDELITY = "benchmarks/quality/results/kv_quant_fidelity.json"
LINE_ATTENTION = "benchmarks/kernels/results/h100_line_attention.json"
STREAMING = "benchmarks/prefill/results/h100-llama-3.1-8b-streaming/speed.json"
COMBINED = "benchmarks/prefill/results/h100-llama-3.1-8b-combined/speed.json"

SHORT, LONG = 32768, 129536  # the decode run's contexts: "32K" and "128K"
# The decode run's recipe names, as `turnkv bench speed --recipes` wrote them.
LSERVE = "lserve prefill=streaming_heads(pattern=random)"
ADA = "ada-snapkv keep_ratio=0.1"


@cache
def load(path: str) -> Any:
    """The parsed JSON of `path`, relative to the repository."""
    return json.loads((REPO / path).read_text())


# -- readers: one value out of one file's layout ---------------------------------------------------

def speed_row(path: str, recipe: str, context: int, engine: str = "turnkv", batch: int = 1) -> dict:
    """The row of a `turnkv bench speed` JSON for (engine, recipe, context, batch)."""
    for row in load(path)["rows"]:
        if (row["engine"], row["recipe"], row["context"], row.get("batch", 1)) == (engine, recipe, context, batch):
            return row
    raise KeyError(f"{path}: no row for {engine} {recipe!r} at {context} x {batch}")


def tpot_ms(recipe: str, context: int) -> float:
    return speed_row(DECODE, recipe, context)["tpot_s"] * 1e3


def decode_speedup(recipe: str) -> float:
    """The full cache's time per token at 128K over the recipe's."""
    return tpot_ms("full", LONG) / tpot_ms(recipe, LONG)


def capacity(path: str) -> dict:
    """The one configuration's results of a capacity_bench.py run."""
    (result,) = load(path)["results"].values()
    return result


def restore_ttft_ms(path: str, strategy: str, history: int = SHORT) -> float:
    for row in load(path)["rows"]:
        if (row["strategy"], row["history"]) == (strategy, history):
            return row["ttft_s"] * 1e3
    raise KeyError(f"{path}: no {strategy} row at {history}")


def quality(path: str, recipe: str, position: str) -> dict:
    """Agreement, KL and KV ratio of a quality run's recipe with the question at `position`."""
    for row in load(path)["by_position_recipe"]:
        if (row["recipe"], row["position"]) == (recipe, position):
            return row
    raise KeyError(f"{path}: no {recipe!r} at {position}")


def eviction_kl(method: str, keep: float, policy: str = "recompress") -> float:
    """Mean KL to the full cache over turns 2-4 (turn 1 compresses only the system prompt)."""
    for row in load(EVICTION)["rows"]:
        if (row["method"], row["policy"], row["keep_ratio"]) == (method, policy, keep):
            return statistics.mean(row["kl"][1:])
    raise KeyError(f"{EVICTION}: no {method} {policy} at {keep}")


def kv_quant_ms(kv: str, batch: int, context: int) -> float:
    for row in load(KV_QUANT)["engine"]:
        if (row["kv"], row["batch"], row["context"]) == (kv, batch, context):
            return row["ms_per_token"]
    raise KeyError(f"{KV_QUANT}: no {kv} row at {batch} x {context}")


def serve(path: str, mode: str, key: str) -> float:
    """One figure of a serve_bench.py run: `mode` is "reuse" or "no_reuse"."""
    return load(path)["results"][mode][key]


def kv_quant_kl(setting: str) -> float:
    """Mean KL to fp32 KV of one setting of the quantized-KV fidelity run."""
    return next(row["kl"] for row in load(KV_QUANT_FIDELITY)["rows"] if row["setting"] == setting)


def prefill_speedup(path: str, recipe: str) -> float:
    return speed_row(path, "full", LONG)["ttft_s"] / speed_row(path, recipe, LONG)["ttft_s"]


# -- formats ----------------------------------------------------------------------------------------

def f2(x: float) -> str:
    return f"{x:.2f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def percent(x: float, digits: int) -> str:
    return f"{x:.{digits}%}"


def f0(x: float) -> str:
    return f"{x:.0f}"


def times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def by_position(recipe: str) -> str:
    """A quality-run recipe's agreement with the question at the begin / middle / end."""
    return " / ".join(f2(quality(QUALITY, recipe, p)["agreement"]) for p in ("begin", "middle", "end"))


def line_attention_ms(context: int = 131072, family: str = "local", target: float = 0.1) -> float:
    """The line kernel's time for a whole prompt of `context` tokens at `target` density."""
    for case in load(LINE_ATTENTION)["cases"]:
        if (case["context"], case["history"]) == (context, 0):
            for row in case["densities"]:
                if (row["family"], row["target"]) == (family, target):
                    return row["kernel_ms"]
    raise KeyError(f"{LINE_ATTENTION}: no {family} row at {target} for {context}")


def krul_table() -> str:
    """docs/methods/krul.md's table: a 32K conversation's returning turn per strategy and shape."""
    lines = ["| shape | recompute | load | krul (`ir_threshold=0`) | krul, plan forced (`fallback=never`) |",
             "|---|---|---|---|---|"]
    for shape, path in [("Llama-3.1-8B (GQA)", STATE_GQA), ("Llama-2-7B (MHA)", STATE_MHA)]:
        krul = next(r for r in load(path)["rows"] if (r["strategy"], r["history"]) == ("krul", SHORT))
        how = (f"stored by `{krul['fallback']}`" if krul.get("fallback")
               else f"{krul['stored_share']:.2f} of the KV stored")
        ms = {strategy: restore_ttft_ms(path, strategy) for strategy in ("recompute", "load", "krul", "krul_split")}
        lines.append(f"| {shape} | {ms['recompute']:.0f} ms | {ms['load']:.1f} ms | {ms['krul']:.1f} ms, {how} | "
                     f"{ms['krul_split']:.1f} ms |")
    return "\n\n" + "\n".join(lines) + "\n\n"


def decode_table() -> str:
    """The headline decode table of docs/benchmarks.md."""
    full_long = tpot_ms("full", LONG)
    lines = ["| recipe | 32K ms/token | 128K ms/token | x full at 128K | of floor at 128K | KV at 128K |",
             "|---|---|---|---|---|---|"]
    for name, recipe in [("full", "full"), ("lserve-random", LSERVE), ("loopserve-d", "loopserve-d"),
                         ("ada-snapkv, keep 0.1", ADA)]:
        long = speed_row(DECODE, recipe, LONG)
        long_ms = long["tpot_s"] * 1e3
        lines.append(f"| {name} | {tpot_ms(recipe, SHORT):.2f} | {long_ms:.2f} | {full_long / long_ms:.2f} | "
                     f"{long['tpot_of_floor']:.2f} | {gb(long['kv_bytes'])} |")
    return "\n\n" + "\n".join(lines) + "\n\n"


# -- the figures ------------------------------------------------------------------------------------

Figure = tuple[str, Callable[[], str]]  # (the JSON file it reads, its value as the page prints it)

FIGURES: dict[str, Figure] = {
    # Decode, Llama-3.1-8B shape, bf16, batch 1, one H100, through LLM.generate.
    "decode.table": (DECODE, decode_table),
    "decode.full.32k.ms": (DECODE, lambda: f2(tpot_ms("full", SHORT))),
    "decode.full.128k.ms": (DECODE, lambda: f2(tpot_ms("full", LONG))),
    "decode.full.128k.of_floor": (DECODE, lambda: f2(speed_row(DECODE, "full", LONG)["tpot_of_floor"])),
    "decode.full.128k.kv": (DECODE, lambda: gb(speed_row(DECODE, "full", LONG)["kv_bytes"])),
    "decode.copy_bandwidth_tb_s": (DECODE, lambda: f2(load(DECODE)["hardware"]["copy_bandwidth"] / 1e12)),
    "decode.full.32k.ttft_s": (DECODE, lambda: f2(speed_row(DECODE, "full", SHORT)["ttft_s"])),
    "decode.full.128k.ttft_s": (DECODE, lambda: f1(speed_row(DECODE, "full", LONG)["ttft_s"])),
    "decode.selecting.128k.range": (DECODE, lambda: "{:.2f} to {:.2f}".format(
        min(tpot_ms(r, LONG) for r in (LSERVE, "loopserve-d", ADA)),
        max(tpot_ms(r, LONG) for r in (LSERVE, "loopserve-d", ADA)))),
    "decode.lserve.128k.ms": (DECODE, lambda: f2(tpot_ms(LSERVE, LONG))),
    "decode.lserve.128k.x": (DECODE, lambda: times(decode_speedup(LSERVE))),
    "decode.lserve.128k.kv": (DECODE, lambda: gb(speed_row(DECODE, LSERVE, LONG)["kv_bytes"])),
    "decode.loopserve.128k.ms": (DECODE, lambda: f2(tpot_ms("loopserve-d", LONG))),
    "decode.loopserve.128k.x": (DECODE, lambda: times(decode_speedup("loopserve-d"))),
    "decode.loopserve.128k.of_floor": (DECODE, lambda: f2(speed_row(DECODE, "loopserve-d", LONG)["tpot_of_floor"])),
    "decode.ada.128k.ms": (DECODE, lambda: f2(tpot_ms(ADA, LONG))),
    "decode.ada.128k.x": (DECODE, lambda: times(decode_speedup(ADA))),
    "decode.ada.128k.kv": (DECODE, lambda: gb(speed_row(DECODE, ADA, LONG)["kv_bytes"])),
    "decode.batch16.tokens_per_s": (BATCH16, lambda: f0(speed_row(BATCH16, "full", 4096, batch=16)["tokens_per_s"])),
    "decode.batch16.x_transformers": (BATCH16, lambda: times(
        speed_row(BATCH16, "full", 4096, batch=16)["tokens_per_s"]
        / speed_row(BATCH16, "full", 4096, engine="transformers", batch=16)["tokens_per_s"], 0)),
    "decode.int8.batch8.x": (KV_QUANT, lambda: times(kv_quant_ms("bf16", 8, SHORT) / kv_quant_ms("int8", 8, SHORT))),
    # CPU, the embedded SmolLM2-135M, 2048-token prompt, turnkv against transformers generate.
    "cpu.ttft.x": (CPU, lambda: times(load(CPU)["single_turn"]["ttft_speedup"])),
    "cpu.decode.x": (CPU, lambda: times(load(CPU)["single_turn"]["decode_speedup"])),
    "cpu.second_turn.x": (CPU, lambda: times(load(CPU)["second_turn"]["ttft_speedup"], 0)),
    # Shared system prompts: a new conversation over a cached 32K-token prompt, H100.
    "prefix.32k.x": (PREFIX, lambda: times(load(PREFIX)["ttft"]["speedup_median"], 0)),
    # Serving at capacity: 64 users x 32K documents, one H100, ada-snapkv keep 0.1 against full.
    "capacity.tokens_per_s.x": (CAPACITY_ADA, lambda: times(
        capacity(CAPACITY_ADA)["output_tokens_per_s"] / capacity(CAPACITY_FULL)["output_tokens_per_s"])),
    "capacity.ada.tokens_per_s": (CAPACITY_ADA, lambda: f0(capacity(CAPACITY_ADA)["output_tokens_per_s"])),
    "capacity.full.tokens_per_s": (CAPACITY_FULL, lambda: f1(capacity(CAPACITY_FULL)["output_tokens_per_s"])),
    "capacity.ada.later_p99_s": (CAPACITY_ADA, lambda: f2(capacity(CAPACITY_ADA)["ttft_later_p99_s"])),
    "capacity.full.later_p99_s": (CAPACITY_FULL, lambda: f0(capacity(CAPACITY_FULL)["ttft_later_p99_s"])),
    "capacity.ada.gpu_at_end": (CAPACITY_ADA, lambda: f0(capacity(CAPACITY_ADA)["conversations_end"]["gpu"])),
    "capacity.ada.itl_prefill_p99_over_p50": (CAPACITY_ADA, lambda: times(
        capacity(CAPACITY_ADA)["itl_during_prefill_p99_s"] / capacity(CAPACITY_ADA)["itl_during_prefill_p50_s"])),
    # Serving with reuse against prefilling every request, H200, 32 conversations x 16K.
    "serve_h200.later_mean.x": (SERVE_H200, lambda: times(
        serve(SERVE_H200, "no_reuse", "ttft_later_mean_s") / serve(SERVE_H200, "reuse", "ttft_later_mean_s"), 1)),
    "serve_h200.reuse.later_mean_s": (SERVE_H200, lambda: f2(serve(SERVE_H200, "reuse", "ttft_later_mean_s"))),
    "serve_h200.no_reuse.later_mean_s": (SERVE_H200, lambda: f1(serve(SERVE_H200, "no_reuse", "ttft_later_mean_s"))),
    "serve_h200.later_p50.x": (SERVE_H200, lambda: times(
        serve(SERVE_H200, "no_reuse", "ttft_later_p50_s") / serve(SERVE_H200, "reuse", "ttft_later_p50_s"), 1)),
    "serve_cpu.reuse.later_mean_s": (SERVE_CPU, lambda: f2(serve(SERVE_CPU, "reuse", "ttft_later_mean_s"))),
    "serve_cpu.no_reuse.later_mean_s": (SERVE_CPU, lambda: f1(serve(SERVE_CPU, "no_reuse", "ttft_later_mean_s"))),
    # Krul: a 32K conversation's returning turn from the CPU tier, through conv.send, H100.
    "krul.mha.ms": (STATE_MHA, lambda: f0(restore_ttft_ms(STATE_MHA, "krul"))),
    "krul.mha.load_ms": (STATE_MHA, lambda: f0(restore_ttft_ms(STATE_MHA, "load"))),
    "krul.mha.recompute_ms": (STATE_MHA, lambda: f0(restore_ttft_ms(STATE_MHA, "recompute"))),
    "krul.mha.x_load": (STATE_MHA, lambda: times(
        restore_ttft_ms(STATE_MHA, "load") / restore_ttft_ms(STATE_MHA, "krul"))),
    "krul.table": (STATE_MHA, krul_table),
    "krul.gqa.forced_over_load": (STATE_GQA, lambda: percent(
        restore_ttft_ms(STATE_GQA, "krul_split") / restore_ttft_ms(STATE_GQA, "load") - 1, 0)),
    "krul.gqa.ms": (STATE_GQA, lambda: f1(restore_ttft_ms(STATE_GQA, "krul"))),
    "krul.gqa.load_ms": (STATE_GQA, lambda: f1(restore_ttft_ms(STATE_GQA, "load"))),
    # Quality on CPU, SmolLM2-135M.
    "quality.flowkv.end.agreement": (QUALITY, lambda: f2(quality(QUALITY, "snapkv@flowkv@0.2", "end")["agreement"])),
    "quality.lserve512.agreement": (QUALITY, lambda: "{:.2f} to {:.2f}".format(
        min(quality(QUALITY, "lserve@512", p)["agreement"] for p in ("begin", "middle", "end")),
        max(quality(QUALITY, "lserve@512", p)["agreement"] for p in ("begin", "middle", "end")))),
    "quality.loopserve_p.middle.agreement": (LOOPSERVE_QUALITY, lambda: f2(
        quality(LOOPSERVE_QUALITY, "loopserve-p", "middle")["agreement"])),
    "quality.loopserve_p.middle.kl": (LOOPSERVE_QUALITY, lambda: f3(
        quality(LOOPSERVE_QUALITY, "loopserve-p", "middle")["kl"])),
    "quality.snapkv.middle.agreement": (LOOPSERVE_QUALITY, lambda: f2(
        quality(LOOPSERVE_QUALITY, "snapkv", "middle")["agreement"])),
    "quality.snapkv.middle.kl": (LOOPSERVE_QUALITY, lambda: f3(quality(LOOPSERVE_QUALITY, "snapkv", "middle")["kl"])),
    "quality.lserve512.kv_ratio": (QUALITY, lambda: f2(statistics.mean(
        quality(QUALITY, "lserve@512", p)["kv_ratio"] for p in ("begin", "middle", "end")))),
    "quality.snapkv_flowkv.0.2.by_position": (QUALITY, lambda: by_position("snapkv@flowkv@0.2")),
    "quality.snapkv_recompress.0.2.by_position": (QUALITY, lambda: by_position("snapkv@recompress@0.2")),
    "eviction.ada.0.1.kl": (EVICTION, lambda: f3(eviction_kl("ada-snapkv", 0.1))),
    "eviction.snapkv.0.1.kl": (EVICTION, lambda: f3(eviction_kl("snapkv", 0.1))),
    "eviction.ada_over_snapkv.0.1.x": (EVICTION, lambda: times(
        eviction_kl("ada-snapkv", 0.1) / eviction_kl("snapkv", 0.1), 1)),
    "eviction.ada.0.5.kl": (EVICTION, lambda: f3(eviction_kl("ada-snapkv", 0.5))),
    "eviction.snapkv.0.5.kl": (EVICTION, lambda: f3(eviction_kl("snapkv", 0.5))),
    "eviction.snapkv.0.25.kl": (EVICTION, lambda: f3(eviction_kl("snapkv", 0.25))),
    "eviction.snapkv_flowkv.0.25.kl": (EVICTION, lambda: f3(eviction_kl("snapkv", 0.25, "flowkv"))),
    "kv_int8.kl": (KV_QUANT_FIDELITY, lambda: f"{kv_quant_kl('int8 KV'):.4f}"),
    # Sparse prefill at 128K, H100.
    "prefill.streaming.128k.x": (STREAMING, lambda: times(
        prefill_speedup(STREAMING, "prefill=streaming_heads(pattern=random)"))),
    "prefill.streaming.128k.kv_share": (STREAMING, lambda: f2(
        speed_row(STREAMING, "prefill=streaming_heads(pattern=random)", LONG)["kv_bytes"]
        / speed_row(STREAMING, "full", LONG)["kv_bytes"])),
    "prefill.combined.128k.x": (COMBINED, lambda: times(
        prefill_speedup(COMBINED, "prefill=streaming_heads(pattern=random,dense=a_shape(local=6144))"))),
    # LoopServe's line kernels at 128K, H100.
    "kernels.line_selection.128k.ms": (LINE_ATTENTION, lambda: f1(load(LINE_ATTENTION)["selection"]["total_ms"])),
    "kernels.line_attention.128k.ms": (LINE_ATTENTION, lambda: f1(line_attention_ms())),
    "kernels.line_selection.128k.share": (LINE_ATTENTION, lambda: percent(
        load(LINE_ATTENTION)["selection"]["total_ms"] / line_attention_ms(), 1)),
}


def value(name: str) -> str:
    if name not in FIGURES:
        raise KeyError(f"no figure named {name!r} in benchmarks/figures.py")
    return FIGURES[name][1]()


def render(text: str) -> str:
    """`text` with every quoted figure's value recomputed from its JSON."""
    return QUOTE.sub(lambda m: f"<!--fig {m.group(1)}-->{value(m.group(1))}<!--/fig-->", text)


def disagreements(text: str) -> list[tuple[str, str, str]]:
    """(name, quoted, computed) for each quote in `text` whose value is not its figure's."""
    quotes = [(m.group(1), m.group(2), value(m.group(1))) for m in QUOTE.finditer(text)]
    return [(name, quoted, computed) for name, quoted, computed in quotes if quoted != computed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list quotes that disagree with their JSON; exit 1 if any")
    parser.add_argument("--list", action="store_true", help="print every figure with its value and file")
    args = parser.parse_args(argv)
    if args.list:
        for name, (path, _) in FIGURES.items():
            shown = value(name).strip().replace("\n", " / ")
            print(f"{name:44} {shown[:60]:60} {path}")
        return 0
    wrong = 0
    for page in PAGES:
        text = page.read_text()
        if args.check:
            for name, quoted, computed in disagreements(text):
                wrong += 1
                print(f"{page.relative_to(REPO)}: {name} quotes {quoted.strip()!r}, "
                      f"its JSON gives {computed.strip()!r}")
        elif render(text) != text:
            page.write_text(render(text))
            print(f"rewrote {page.relative_to(REPO)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
