"""Aggregating quality results into tables and plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from turnkv.paths import user_path


def _mean(values):
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def aggregate(records: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Mean score, agreement, KL and KV-bytes ratio per group of `keys`."""
    groups = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r)
    rows = []
    for group, rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        rows.append({**dict(zip(keys, group)), "n": len(rs),
                     "score": _mean(r["score"] for r in rs),
                     "agreement": _mean(r.get("agreement") for r in rs),
                     "kl": _mean(r.get("kl") for r in rs),
                     "kv_ratio": _mean(r["kv_bytes"] / r["full_kv_bytes"] for r in rs if r.get("full_kv_bytes")),
                     # Prefill density and TTFT only exist in records written since they were recorded.
                     "density": _mean(r.get("density") for r in rs),
                     "ttft_s": _mean(r.get("ttft_s") for r in rs)})
    return rows


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _runs(runs: list[dict]) -> list[str]:
    """What each invocation that ran conversations took (a resumed run has several)."""
    if not runs:
        return []
    lines = ["Runs (wall time of each invocation that ran conversations):", ""]
    for r in runs:
        how = (f"{r.get('workers', 1)} worker(s), batches of {r.get('batch')} recipes" if r.get("lockstep", True)
               else "one conversation at a time")
        lines.append(f"- {r['started']}: {r['conversations']} conversations in {r['wall_s'] / 60:.1f} min "
                     f"({how}; {r.get('machine', '')})")
    total = sum(r["wall_s"] for r in runs)
    conversations = sum(r["conversations"] for r in runs)
    lines += ["", f"Total wall time: {total / 60:.1f} min for {conversations} conversations.", ""]
    return lines


def write_report(records: list[dict], out_dir: str | Path, header: dict) -> dict:
    """JSON summary, a Markdown report and PNG plots in out_dir; returns the summary."""
    out_dir = user_path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        **header,
        "by_recipe": aggregate(records, ("recipe",)),
        "by_task_recipe": aggregate(records, ("task", "recipe")),
        "by_position_recipe": aggregate(records, ("position", "recipe")),
        "by_turn_recipe": aggregate(records, ("turn", "recipe")),
        "by_task_position_recipe_turn": aggregate(records, ("task", "position", "recipe", "turn")),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# turnkv bench quality: {header.get('model', '')}", "",
             f"Command: `{header.get('command', '')}`", "", f"Settings: {json.dumps(header.get('settings', {}))}", "",
             *_runs(header.get("runs") or []),
             "Score: the task metric per turn (mean). Agreement: teacher-forced top-1 agreement with the full-cache "
             "run's answer. KL: mean KL(full || recipe) along it. KV: bytes held after the turn against the full "
             "cache's. Density: the share of causal attention cells a sparse prefill computed. TTFT: seconds to "
             "the first token of a turn (mean over turns).", "", "## By recipe", "",
             "| recipe | turns scored | score | agreement | KL | KV vs full | prefill density | TTFT s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["by_recipe"]:
        lines.append(f"| {r['recipe']} | {r['n']} | {_fmt(r['score'])} | {_fmt(r['agreement'])} | {_fmt(r['kl'])} | "
                     f"{_fmt(r['kv_ratio'], 2)} | {_fmt(r['density'], 3)} | {_fmt(r['ttft_s'], 3)} |")
    tables = (("By task", "task", "score"), ("By question position", "position", "score"),
              ("By question position", "position", "agreement"), ("By turn", "turn", "score"))
    for title, key, first in tables:
        rows = summary[f"by_{key}_recipe"]
        recipes = sorted({r["recipe"] for r in rows})
        values = sorted({r[key] for r in rows}, key=str)
        lines += ["", f"## {title} ({first} / KL)", "", f"| {key} | " + " | ".join(recipes) + " |",
                  "|---|" + "---|" * len(recipes)]
        cell = {(r[key], r["recipe"]): r for r in rows}
        for v in values:
            lines.append(f"| {v} | " + " | ".join(
                f"{_fmt(cell[(v, rc)][first], 2)} / {_fmt(cell[(v, rc)]['kl'], 3)}" if (v, rc) in cell else "-"
                for rc in recipes) + " |")
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    _plots(summary, out_dir)
    return summary


def _plots(summary: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_recipe = summary["by_recipe"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("score", "agreement")):
        for r in by_recipe:
            if r["kv_ratio"] is not None and r[metric] is not None:
                ax.scatter(r["kv_ratio"], r[metric])
                ax.annotate(r["recipe"], (r["kv_ratio"], r[metric]), fontsize=7)
        ax.set_xlabel("KV bytes / full")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle("Quality and fidelity against KV memory")
    fig.tight_layout()
    fig.savefig(out_dir / "score_vs_kv.png", dpi=120)
    plt.close(fig)

    for key, name, kind in (("position", "per_position.png", "bar"), ("turn", "per_turn.png", "line")):
        rows = summary[f"by_{key}_recipe"]
        recipes = sorted({r["recipe"] for r in rows})
        values = sorted({r[key] for r in rows}, key=str)
        cell = {(r[key], r["recipe"]): r["score"] for r in rows}
        fig, ax = plt.subplots(figsize=(max(6, len(recipes) * 1.2), 4))
        width = 0.8 / max(1, len(values))
        for j, v in enumerate(values):
            ys = [cell.get((v, rc)) or 0.0 for rc in recipes]
            if kind == "bar":
                ax.bar([i + j * width for i in range(len(recipes))], ys, width, label=str(v))
        if kind == "line":
            for rc in recipes:
                ax.plot(values, [cell.get((v, rc)) or 0.0 for v in values], marker="o", label=rc)
            ax.set_xlabel("turn")
        else:
            ax.set_xticks([i + width * (len(values) - 1) / 2 for i in range(len(recipes))], recipes, rotation=30,
                          ha="right", fontsize=8)
        ax.set_ylabel("score")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
