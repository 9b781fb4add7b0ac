"""No Python file of the package, its tests or its benchmarks runs over 500 lines: past that a file
holds more than one job, and is split by job (not cut at the limit)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 500


def test_no_python_file_is_over_the_limit():
    files = [path for folder in ("turnkv", "tests", "benchmarks") for path in (REPO / folder).rglob("*.py")]
    assert len(files) > 100  # the walk found the code
    lengths = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in files}
    assert {name: n for name, n in lengths.items() if n > LIMIT} == {}
