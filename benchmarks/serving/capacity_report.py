"""The capacity benchmark's figures from one configuration's records and /metrics samples, the
Markdown table over configurations, and the plots."""

from __future__ import annotations

import re

from capacity_client import metric


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def _gaps(records: list[dict]) -> list[tuple[float, float, int]]:
    """(start, end, user) of every gap between two streamed chunks of one reply."""
    out = []
    for r in records:
        out += [(a, b, r["user"]) for a, b in zip(r["chunks"], r["chunks"][1:])]
    return out


def summarise(records: list[dict], wall_s: float, samples: list[tuple[float, dict]]) -> dict:
    ok = [r for r in records if not {"failed", "unplayed", "unfinished"} & set(r)]
    turns = sorted({r["turn"] for r in ok})
    ttft = {t: [r["first"] - r["sent"] for r in ok if r["turn"] == t] for t in turns}
    later = [v for t in turns if t > 1 for v in ttft[t]]
    gaps = _gaps(ok)
    # Gaps of a running stream while another user's first turn (its long prompt) is being prefilled.
    prefills = [(r["sent"], r["first"], r["user"]) for r in ok if r["turn"] == 1]
    during = [b - a for a, b, u in gaps if any(s < b and a < f and v != u for s, f, v in prefills)]
    end = samples[-1][1]
    gpu_peak = max(metric(s, "vllm:num_requests_running") + metric(s, "turnkv:stored_conversations", tier="gpu")
                   for _, s in samples)
    return {
        "wall_s": wall_s,
        "requests": len(records),
        "failed": sum("failed" in r for r in records),
        "unplayed": sum("unplayed" in r for r in records),  # turns not started before --deadline-s
        "unfinished": sum("unfinished" in r for r in records),  # turns cut at --cut-s
        "retries": sum(r.get("retries", 0) for r in records),  # 429 / 503 answers retried after 1 s
        "output_tokens": sum(r["completion_tokens"] for r in ok),
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall_s,
        "ttft_by_turn": {t: {"p50_s": percentile(v, 50), "p99_s": percentile(v, 99), "n": len(v)}
                         for t, v in ttft.items()},
        "ttft_later_p50_s": percentile(later, 50),
        "ttft_later_p99_s": percentile(later, 99),
        "itl_p50_s": percentile([b - a for a, b, _ in gaps], 50),
        "itl_p99_s": percentile([b - a for a, b, _ in gaps], 99),
        "itl_during_prefill_p50_s": percentile(during, 50),
        "itl_during_prefill_p99_s": percentile(during, 99),
        "itl_during_prefill_gaps": len(during),
        # The worker's own inter-token times (vLLM's histogram): where these stay low while the client's
        # are high, the time is lost between the worker and the client, not in the engine.
        "itl_server_p50_le_s": _bucket_quantile(end, "vllm:inter_token_latency_seconds", 50),
        "itl_server_p99_le_s": _bucket_quantile(end, "vllm:inter_token_latency_seconds", 99),
        "conversations_gpu_peak": gpu_peak,
        "conversations_end": {tier: metric(end, "turnkv:stored_conversations", tier=tier)
                              for tier in ("gpu", "cpu", "disk")},
        "conversations_offloaded": metric(end, "turnkv:conversation_evictions_total", reason="offloaded"),
        "conversations_dropped": metric(end, "turnkv:conversation_evictions_total", reason="dropped"),
        "kv_bytes_peak": max(metric(s, "turnkv:kv_pool_bytes_used") for _, s in samples),
        "kv_bytes_capacity": metric(end, "turnkv:kv_pool_bytes_capacity"),
        "tier_bytes": {d: metric(end, "turnkv:tier_traffic_bytes_total", direction=d) for d in ("offload", "restore")},
        "tier_seconds": {d: metric(end, "turnkv:tier_traffic_seconds_total", direction=d)
                         for d in ("offload", "restore")},
        "tokens_reused": metric(end, "turnkv:reused_tokens_total"),
        "tokens_prefilled": metric(end, "turnkv:prefilled_tokens_total"),
        "mixed_steps": metric(end, "turnkv:mixed_steps_total"),
        "device_alloc_retries": metric(end, "turnkv:device_alloc_retries"),
        "requests_failed_on_server": metric(end, "turnkv:requests_failed_total"),
        "worker_phases": {p: _phase(end, p) for p in PHASES},
        # Packs of conversations leaving the GPU that ran beside the worker (state=krul and the like).
        "background_packs": {"count": metric(end, "turnkv:state_packs_completed"),
                             "seconds": metric(end, "turnkv:state_pack_seconds")},
    }


def _bucket_quantile(end: dict, name: str, q: float) -> float | None:
    """The upper edge of the histogram bucket that holds the q-th percentile (None without samples)."""
    edges = sorted({float(e) for key in end if key.startswith(name + "_bucket{")
                    for e in re.findall(r'le="([^"]+)"', key)})
    count = metric(end, name + "_count")
    for edge in edges:
        if count and metric(end, name + "_bucket", le=_le(edge)) >= q / 100 * count:
            return edge
    return None


def _le(edge: float) -> str:
    """A bucket edge as prometheus_client writes it in the `le` label."""
    return "+Inf" if edge == float("inf") else repr(edge)


SLOW_GAP_S = 0.25


def timeline(records: list[dict]) -> dict:
    """What a later look at a run needs to place its slow moments: every played turn as [user, turn,
    sent, first token, end] and every gap between two streamed chunks over SLOW_GAP_S as [start,
    end, user], in seconds from the run's start."""
    played = [r for r in records if all(k in r for k in ("sent", "first", "end", "chunks"))]
    return {"turns": [[r["user"], r["turn"], *(round(r[k], 3) for k in ("sent", "first", "end"))] for r in played],
            "slow_gaps": [[round(a, 3), round(b, 3), u] for a, b, u in _gaps(played) if b - a > SLOW_GAP_S]}


PHASES = ("admit", "prefill", "decode", "mixed", "finish")


def _phase(end: dict, phase: str) -> dict:
    """Where the server's worker spent its time: a phase's iterations, seconds in all, and the
    iterations over 250 ms (the histogram's bucket edge)."""
    name = "turnkv:worker_phase_seconds"
    count = metric(end, name + "_count", phase=phase)
    return {"count": count, "seconds": metric(end, name + "_sum", phase=phase),
            "over_250ms": count - metric(end, name + "_bucket", phase=phase, le="0.25")}


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "GiB":
        return f"{value / 2**30:.3f}"
    if unit == "MiB":
        return f"{value / 2**20:.1f}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return f"{int(value)}"


def table(results: dict[str, dict]) -> str:
    """A Markdown table: one column per configuration."""
    names = list(results)
    turns = sorted({int(t) for r in results.values() for t in r["ttft_by_turn"]})
    rows = [("aggregate output tokens/s", lambda r: r["output_tokens_per_s"], ""),
            ("requests (failed, retried, unplayed, unfinished)",
             lambda r: f"{r['requests']} ({r['failed']}, {r.get('retries', 0)}, {r.get('unplayed', 0)}, "
                       f"{r.get('unfinished', 0)})", "")]
    for t in turns:
        rows.append((f"TTFT turn {t} p50 / p99 (ms)", lambda r, t=t: _pair(r["ttft_by_turn"].get(t, r["ttft_by_turn"]
                                                                                                  .get(str(t)))), ""))
    rows += [("TTFT turns 2+ p50 / p99 (ms)", lambda r: _pair({"p50_s": r["ttft_later_p50_s"],
                                                              "p99_s": r["ttft_later_p99_s"]}), ""),
             ("inter-token p50 / p99 (ms)", lambda r: _pair({"p50_s": r["itl_p50_s"], "p99_s": r["itl_p99_s"]}), ""),
             ("inter-token while a turn 1 prefills, p50 / p99 (ms)",
              lambda r: _pair({"p50_s": r["itl_during_prefill_p50_s"], "p99_s": r["itl_during_prefill_p99_s"]}), ""),
             ("inter-token on the server (histogram bucket edges), p50 / p99 (ms)",
              lambda r: _pair({"p50_s": r.get("itl_server_p50_le_s"), "p99_s": r.get("itl_server_p99_le_s")}), ""),
             ("device allocator retries (cache freed, device synchronized)",
              lambda r: r.get("device_alloc_retries"), ""),
             ("client event loop stalls over 100 ms: count / longest (ms)",
              lambda r: f"{r['client_loop_stalls']['count']} / {_fmt(r['client_loop_stalls']['longest_s'], 'ms')}"
              if "client_loop_stalls" in r else "-", ""),
             ("conversations on GPU, peak", lambda r: r["conversations_gpu_peak"], ""),
             ("conversations at the end: GPU / CPU / disk",
              lambda r: " / ".join(_fmt(r["conversations_end"][t]) for t in ("gpu", "cpu", "disk")), ""),
             ("conversations offloaded / dropped",
              lambda r: f"{_fmt(r['conversations_offloaded'])} / {_fmt(r['conversations_dropped'])}", ""),
             ("KV bytes used, peak (MiB)", lambda r: r["kv_bytes_peak"], "MiB"),
             ("tier traffic offload / restore (MiB)",
              lambda r: f"{_fmt(r['tier_bytes']['offload'], 'MiB')} / {_fmt(r['tier_bytes']['restore'], 'MiB')}", ""),
             ("tier seconds offload / restore",
              lambda r: f"{_fmt(r['tier_seconds']['offload'])} / {_fmt(r['tier_seconds']['restore'])}", ""),
             ("prompt tokens reused / prefilled",
              lambda r: f"{_fmt(r['tokens_reused'])} / {_fmt(r['tokens_prefilled'])}", ""),
             ("mixed steps", lambda r: r["mixed_steps"], ""),
             ("packs beside the worker: count / seconds",
              lambda r: f"{_fmt(r['background_packs']['count'])} / {r['background_packs']['seconds']:.1f}"
              if "background_packs" in r else "-", "")]
    for p in PHASES:
        rows.append((f"worker {p}: iterations / seconds / over 250 ms",
                     lambda r, p=p: _phase_cell(r.get("worker_phases", {}).get(p)), ""))
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, get, unit in rows:
        cells = [get(results[n]) for n in names]
        lines.append(f"| {label} | " + " | ".join(c if isinstance(c, str) else _fmt(c, unit) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _phase_cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    return f"{_fmt(entry['count'])} / {entry['seconds']:.1f} / {_fmt(entry['over_250ms'])}"


def _pair(entry: dict | None) -> str:
    if entry is None:
        return "-"
    return f"{_fmt(entry['p50_s'], 'ms')} / {_fmt(entry['p99_s'], 'ms')}"


def plot(results: dict[str, dict], stem: str) -> list[str]:
    """stem_ttft.png (TTFT p50 and p99 by turn index) and stem_capacity.png (tokens/s, where the
    conversations are); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, r in results.items():
        turns = sorted(int(t) for t in r["ttft_by_turn"])
        by = {int(t): v for t, v in r["ttft_by_turn"].items()}
        for ax, key in zip(axes, ("p50_s", "p99_s")):
            ax.plot(turns, [by[t][key] for t in turns], marker="o", label=name)
    for ax, title in zip(axes, ("TTFT p50", "TTFT p99")):
        ax.set_yscale("log")
        ax.set_xlabel("turn")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    paths = [f"{stem}_ttft.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [results[n]["output_tokens_per_s"] for n in names])
    axes[0].set_title("aggregate output tokens/s")
    bottom = [0.0] * len(names)
    for tier in ("gpu", "cpu", "disk"):
        values = [results[n]["conversations_end"][tier] for n in names]
        axes[1].bar(names, values, bottom=bottom, label=f"kept on {tier}")
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].bar(names, [results[n]["conversations_dropped"] for n in names], bottom=bottom, label="dropped")
    axes[1].set_title("conversations at the end of the run")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    paths.append(f"{stem}_capacity.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
