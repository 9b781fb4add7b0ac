"""The capacity report reads the server's own inter-token histogram back as bucket-edge percentiles."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serving"))
import capacity_report  # noqa: E402

NAME = "vllm:inter_token_latency_seconds"


def samples(values: list[float]) -> dict[str, float]:
    """/metrics as the client's scrape returns it, for a histogram of `values` with a model label."""
    registry = CollectorRegistry()
    histogram = Histogram(NAME, "gaps", ["model_name"], buckets=(0.01, 0.1, 0.3, 1.0), registry=registry)
    for v in values:
        histogram.labels("bench").observe(v)
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_bucket_quantile_gives_the_edge_of_the_bucket_holding_the_percentile():
    end = samples([0.005] * 50 + [0.05] * 48 + [0.2, 0.5])
    assert capacity_report._bucket_quantile(end, NAME, 50) == 0.01
    assert capacity_report._bucket_quantile(end, NAME, 98) == 0.1
    assert capacity_report._bucket_quantile(end, NAME, 99) == 0.3
    assert capacity_report._bucket_quantile(end, NAME, 100) == 1.0
    assert capacity_report._bucket_quantile(samples([5.0]), NAME, 99) == float("inf")
    assert capacity_report._bucket_quantile(samples([]), NAME, 99) is None
