"""The plots of the docs' benchmarks page, drawn from the committed result files (no measurement).

Usage: python benchmarks/plots.py [--out docs/img]

Each plot reads one JSON under benchmarks/<topic>/results/ (SOURCES names them) and writes one PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
SOURCES = {
    "decode_vs_context.png": "decode/results/h100-llama-3.1-8b-engine-path-eb30d5a/speed.json",
    "kv_vs_budget.png": "quality/results/eviction_multiturn.json",
    "fidelity_vs_keep_ratio.png": "quality/results/smollm2-hour/summary.json",
    "restore_ttft.png": "state/results/h100_state_restore_mha_engine_path.json",
    "serving_ttft_by_turn.png": "serving/results/serve_gpu_h200.json",
}
MS = 1e3


def _load(name: str) -> dict:
    return json.loads((HERE / SOURCES[name]).read_text())


def decode_vs_context(ax, data: dict) -> None:
    """ms per token against context for each recipe, and the full cache's floor (weights + KV over bandwidth)."""
    labels = {"full": "full", "loopserve-d": "loopserve-d", "ada-snapkv keep_ratio=0.1": "ada-snapkv, keep 0.1"}
    rows = [r for r in data["rows"] if r["engine"] == "turnkv" and r["batch"] == 1]
    for recipe in data["recipes"]:
        mine = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["context"])
        label = labels.get(recipe, "lserve" if recipe.startswith("lserve") else recipe)
        ax.plot([r["context"] / 1024 for r in mine], [r["tpot_s"] * MS for r in mine], "o-", label=label)
    full = sorted((r for r in rows if r["recipe"] == "full"), key=lambda r: r["context"])
    ax.plot([r["context"] / 1024 for r in full], [r["tpot_floor_s"] * MS for r in full], "k--", label="full: floor")
    ax.set(xlabel="context (K tokens)", ylabel="ms per token", ylim=(0, None),
           title=f"Decode, {data['model']} {data['dtype']}, batch 1, {data['hardware']['device']}")


def kv_vs_budget(ax, data: dict) -> None:
    """KV bytes after the last turn, over the full cache's, against keep ratio, per eviction method."""
    rows = [r for r in data["rows"] if r["policy"] == "recompress"]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["keep_ratio"])
        ax.plot([r["keep_ratio"] for r in mine], [r["kv_bytes_vs_full"][-1] for r in mine], "o-", label=method)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":", label="KV = keep ratio")
    ax.set(xlabel="keep ratio (of the history)", ylabel="KV bytes / full cache, after turn 4", xlim=(0, 0.6),
           ylim=(0, 1), title="Memory falls with the budget (SmolLM2-135M, CPU, 4 turns)")


def fidelity_vs_keep_ratio(axes, data: dict) -> None:
    """Teacher-forced agreement with the full cache against keep ratio, one panel per question position."""
    # Labels are METHOD@POLICY@RATIO for the core recipes, METHOD@RATIO for those run under recompress only.
    methods = ("streaming-llm", "h2o", "snapkv", "ada-snapkv", "pyramidkv", "tova", "random")
    rows = data["by_position_recipe"]
    for ax, position in zip(axes, ("begin", "middle", "end")):
        for method in methods:
            points = sorted((float(r["recipe"].rsplit("@", 1)[1]), r["agreement"]) for r in rows
                            if r["position"] == position
                            and r["recipe"].rsplit("@", 1)[0] in (method, method + "@recompress"))
            ax.plot(*zip(*points), "o-", label=method)
        ax.set(title=f"question at the {position}", xlabel="keep ratio", xticks=(0.2, 0.5), xlim=(0.1, 0.6),
               ylim=(0.7, 1.0), yticks=(0.7, 0.8, 0.9, 1.0))
        ax.tick_params(labelleft=True)
    axes[0].set_ylabel("agreement with the full cache")


def restore_ttft(ax, data: dict) -> None:
    """TTFT of a returning conversation against its history, per restore strategy."""
    rows = data["rows"]
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["history"])
        ax.plot([r["history"] / 1024 for r in mine], [r["ttft_s"] * MS for r in mine], "o-", label=strategy)
    ax.set(xlabel="history (K tokens)", ylabel="TTFT (ms)", yscale="log",
           title=f"Restore from the CPU tier, {data['shape']} {data['dtype']}, {data['device']}")


def serving_ttft_by_turn(ax, data: dict) -> None:
    """Mean TTFT per turn index, the server with reuse and with --no-reuse."""
    for key, label in (("reuse", "reuse"), ("no_reuse", "--no-reuse")):
        by_turn = data["results"][key]["ttft_by_turn_mean_s"]
        turns = sorted(by_turn, key=int)
        ax.plot([int(t) for t in turns], [by_turn[t] for t in turns], "o-", label=label)
    args = data["args"]
    ax.set(xlabel="turn", ylabel="mean TTFT (s)", xticks=(1, 2, 3, 4), ylim=(0, None),
           title=f"turnkv serve, {args['conversations']} conversations x {args['history']} tokens, {args['model']}")


def draw(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (("decode_vs_context.png", decode_vs_context), ("kv_vs_budget.png", kv_vs_budget),
                       ("restore_ttft.png", restore_ttft), ("serving_ttft_by_turn.png", serving_ttft_by_turn)):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        plot(ax, _load(name))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8), sharey=True)
    fidelity_vs_keep_ratio(axes, _load("fidelity_vs_keep_ratio.png"))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle("Fidelity by question position (SmolLM2-135M, CPU, 3 turns, recompress)")
    fig.tight_layout()
    fig.savefig(out / "fidelity_vs_keep_ratio.png", dpi=110)
    plt.close(fig)
    written.append(out / "fidelity_vs_keep_ratio.png")
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "img"))
    for path in draw(Path(parser.parse_args(argv).out)):
        print(path)


if __name__ == "__main__":
    main()
