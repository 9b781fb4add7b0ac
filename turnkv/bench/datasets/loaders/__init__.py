"""Loaders for the public benchmark files (being split by format; see reading.py)."""

from turnkv.bench.datasets.loaders.reading import *  # noqa: F403
from turnkv.bench.datasets.loaders.reading import __all__  # noqa: F401
