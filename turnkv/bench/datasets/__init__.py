"""Quality-benchmark datasets: the instance schema, and loaders for public benchmark files."""

from turnkv.bench.datasets.schema import METRICS, POSITIONS, Instance, Turn

__all__ = ["METRICS", "POSITIONS", "Instance", "Turn"]
