"""ruff check is clean over the package, its tests and its benchmarks (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                           "turnkv", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
