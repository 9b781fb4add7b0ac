"""The README's and the docs' headline figures come from the committed JSON (benchmarks/figures.py):
every quoted figure equals what its JSON gives, every quote names a known figure, and the pages' headline
places (the README, the recipe guide, the "Headline" section of the benchmarks page, the "Measured" sections of the
method pages and of the serving page) quote no measured number outside a figure."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import figures
finally:
    sys.path.remove(str(REPO / "benchmarks"))

# A measured number with its unit: 1.80x, 6.19 ms, 0.64 s, 16.99 GB, 1694 tokens/s.
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:x\b| ?ms\b| (?:s|GB|MB|TB/s|tokens/s)\b)")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", figures.PAGES, ids=_rel)
def test_every_quoted_figure_agrees_with_its_json(page):
    wrong = figures.disagreements(page.read_text())
    assert not wrong, "run python benchmarks/figures.py:\n" + "\n".join(
        f"{name}: the page says {quoted.strip()!r}, the JSON gives {computed.strip()!r}"
        for name, quoted, computed in wrong)


@pytest.mark.parametrize("page", figures.PAGES, ids=_rel)
def test_every_figure_marker_is_a_whole_quote(page):
    # A marker the pattern does not take (a misspelt name, a missing end) would be left unchecked.
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # code spans may show the syntax
    assert text.count("<!--fig ") == len(figures.QUOTE.findall(text)), f"{_rel(page)}: a malformed figure quote"
    assert text.count("<!--/fig-->") == len(figures.QUOTE.findall(text)), f"{_rel(page)}: a malformed figure quote"


def test_every_figure_reads_an_existing_file_and_gives_a_value():
    for name, (path, _) in figures.FIGURES.items():
        assert (REPO / path).is_file(), f"{name} reads {path}, which does not exist"
        assert figures.value(name).strip(), name


def test_a_quote_of_an_unknown_figure_is_an_error():
    with pytest.raises(KeyError, match="no figure named 'decode.nothing'"):
        figures.disagreements("<!--fig decode.nothing-->1.00x<!--/fig-->")


def test_a_wrong_quote_is_reported_and_rewritten():
    right = figures.value("decode.full.128k.ms")
    text = "full cache: <!--fig decode.full.128k.ms-->99.99<!--/fig--> ms per token"
    assert figures.disagreements(text) == [("decode.full.128k.ms", "99.99", right)]
    assert figures.render(text) == f"full cache: <!--fig decode.full.128k.ms-->{right}<!--/fig--> ms per token"


def test_a_figure_follows_its_json(monkeypatch):
    # The value is computed from the file's numbers, not stored beside it.
    run = figures.load(figures.DECODE)
    edited = {**run, "rows": [dict(row) for row in run["rows"]]}
    for row in edited["rows"]:
        if (row["recipe"], row["context"]) == ("full", figures.LONG):
            row["tpot_s"] = 0.02
    monkeypatch.setattr(figures, "load", lambda path: edited if path == figures.DECODE else run)
    assert figures.value("decode.full.128k.ms") == "20.00"
    ada_ms = figures.speed_row(figures.DECODE, figures.ADA, figures.LONG)["tpot_s"] * 1e3
    assert figures.value("decode.ada.128k.x") == f"{20.0 / ada_ms:.2f}x"


def _headline_text(page: Path) -> str:
    """The page's headline places, without code blocks."""
    text = page.read_text()
    if page in (REPO / "README.md", REPO / "docs/recipes.md"):
        part = text
    elif page == REPO / "docs/benchmarks.md":
        part = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    else:
        part = text.split("## Measured", 1)[1].split("\n## ", 1)[0] if "## Measured" in text else ""
    return FENCED.sub("", part)


HEADLINE_PAGES = [REPO / "README.md", REPO / "docs/recipes.md", REPO / "docs/benchmarks.md", REPO / "docs/serving.md",
                  *sorted((REPO / "docs/methods").glob("*.md"))]


@pytest.mark.parametrize("page", HEADLINE_PAGES, ids=_rel)
def test_headline_numbers_are_quoted_figures(page):
    outside = figures.QUOTE.sub("", _headline_text(page))
    assert not MEASURED.findall(outside), (
        f"{_rel(page)} states {MEASURED.findall(outside)} outside a figure: add it to benchmarks/figures.py "
        "and quote it as <!--fig NAME-->VALUE<!--/fig-->")


def test_the_headline_check_sees_a_bare_number():
    assert MEASURED.findall("decodes 1.80x faster, 6.19 ms, p99 0.64 s, 1694 tokens/s, 1.71 GB") == \
        ["1.80x", "6.19 ms", "0.64 s", "1694 tokens/s", "1.71 GB"]
    assert not MEASURED.findall("Llama-3.1-8B at 128K on an H100 80GB, 32 tokens per KV head, keep 0.1, 56GiB")
