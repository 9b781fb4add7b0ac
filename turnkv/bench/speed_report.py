"""Write a speed run: JSON (everything), a Markdown table, and PNG plots of latency and floor fraction."""

from __future__ import annotations

import json
from pathlib import Path

from turnkv.paths import user_path


def _ms(x):
    return "" if x is None else f"{1e3 * x:.2f}"


def _frac(x):
    return "" if x is None else f"{x:.2f}"


def _kv(result: dict) -> str:
    kv = result.get("kv_dtype", "none")
    return "" if kv == "none" else f", KV {kv}"


def _parallel(result: dict) -> list[str]:
    """A line on the ranks of a tensor-parallel run (none on one device)."""
    n = result.get("tensor_parallel", 1)
    if n == 1:
        return []
    return [f"Tensor parallel over {n} ranks ({', '.join(result.get('devices', []))}): times are rank 0's; the "
            "weights, floors and KV bytes are rank 0's shard.", ""]


def markdown(result: dict, command: str) -> str:
    hw = result["hardware"]
    lines = [
        f"# turnkv bench speed: {result['model']} ({result['dtype']}{_kv(result)}) on {hw['device']}", "",
        f"Command: `{command}`", "",
        f"Measured in this run: copy bandwidth {hw['copy_bandwidth'] / 1e12:.2f} TB/s, "
        f"matmul {hw['matmul_rate'] / 1e12:.1f} TFLOP/s, weights {hw['weight_bytes'] / 1e9:.2f} GB. "
        "Floors: decode = (weights + KV read) / bandwidth; prefill = the longer of FLOPs / matmul rate "
        "and (weights + KV attended) / bandwidth. "
        "'of floor' = floor / measured (1.00 = at the floor).", "",
        *_parallel(result),
        "| engine | recipe | context | batch | TTFT ms | of floor | ms/token | of floor | tokens/s | KV GB | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "turns" in r:
            continue
        if "unavailable" in r:
            lines.append(f"| {r['engine']} | {r['recipe']} | {r['context']} | {r['batch']} | not run: {r['unavailable']} |"
                         " | | | | | |")
            continue
        kv, tps, peak = r.get("kv_bytes"), r.get("tokens_per_s"), r.get("peak_gb")
        lines.append(
            f"| {r['engine']} | {r['recipe']} | {r['context']} | {r['batch']} | {_ms(r.get('ttft_s'))} | "
            f"{_frac(r.get('ttft_of_floor'))} | {_ms(r.get('tpot_s'))} | {_frac(r.get('tpot_of_floor'))} | "
            f"{'' if tps is None else f'{tps:.1f}'} | {'' if kv is None else f'{kv / 1e9:.3f}'} | "
            f"{'' if peak is None else f'{peak:.1f}'} |")
    turns = [r for r in result["rows"] if "turns" in r]
    if turns:
        lines += ["", "## Later turns against kept history", "",
                  "| context | turn | history | new tokens | prefill ms | of floor | re-prefill whole history ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in turns:
            for t in r["turns"]:
                lines.append(f"| {r['context']} | {t['turn']} | {t['history_tokens']} | {t['new_tokens']} | "
                             f"{_ms(t['prefill_s'])} | {t['floor_s'] / t['prefill_s']:.2f} | "
                             f"{_ms(t.get('reprefill_whole_history_s'))} |")
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "unavailable" not in r and "turns" not in r and r["batch"] == 1]
    written = []
    for metric, label in (("tpot_s", "ms per output token"), ("ttft_s", "TTFT (ms)")):
        fig, (ax, ax_floor) = plt.subplots(1, 2, figsize=(11, 4))
        for key in sorted({(r["engine"], r["recipe"]) for r in rows}):
            pts = sorted((r["context"], r[metric], r.get(metric.replace("_s", "_of_floor")))
                         for r in rows if (r["engine"], r["recipe"]) == key and r.get(metric) is not None)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], marker="o", label=" / ".join(key))
            if all(p[2] is not None for p in pts):
                ax_floor.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=" / ".join(key))
        for a in (ax, ax_floor):
            a.set_xscale("log", base=2)
            a.set_xlabel("context (tokens)")
            a.grid(alpha=0.3)
        ax.set_ylabel(label)
        ax_floor.set_ylabel("fraction of the hardware floor")
        ax_floor.set_ylim(0, 1.1)
        if ax.get_legend_handles_labels()[0]:  # a run whose rows lack this figure draws no lines
            ax.legend(fontsize=7)
        fig.suptitle(f"{result['model']} on {result['hardware']['device']}")
        fig.tight_layout()
        path = out / f"{metric.removesuffix('_s')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write(result: dict, out: str | Path, command: str) -> str:
    out = user_path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "command": command}
    (out / "speed.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result, command)
    (out / "report.md").write_text(text)
    plots(result, out)
    return text
