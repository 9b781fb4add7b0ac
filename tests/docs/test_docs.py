"""The documentation is checked like code: the site builds with `mkdocs build --strict`, the README
stays short with its two commands on the first screen, the pages hold no issue numbers, "in progress"
or links outside the repository, every path they quote exists, and every code block marked runnable
(an HTML comment `<!-- run -->` on the line before its fence) runs on CPU with the embedded model.
A runnable Python block whose next fenced block is marked `<!-- output -->` must print exactly that
block's text (greedy decoding in fp32 on CPU is deterministic)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").glob("*/README.md"),
                REPO / "benchmarks" / "README.md"])
RUN_MARK = "<!-- run -->"
OUTPUT_MARK = "<!-- output -->"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _marked(text: str, start: int, mark: str) -> bool:
    """Whether the last non-empty line before offset `start` is `mark`."""
    return text[:start].rstrip("\n").rsplit("\n", 1)[-1].strip() == mark


def runnable_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, expected output) of each fenced block whose fence line follows a `<!-- run -->`
    line; the expected output is the text of the next fenced block when that one follows an
    `<!-- output -->` line, else None."""
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, match in enumerate(fences):
        if not _marked(text, match.start(), RUN_MARK):
            continue
        following = fences[i + 1] if i + 1 < len(fences) else None
        expected = following.group(2) if following and _marked(text, following.start(), OUTPUT_MARK) else None
        blocks.append((match.group(1), match.group(2), expected))
    return blocks


def test_output_blocks_follow_runnable_python_blocks():
    # An `<!-- output -->` block that no runnable Python block precedes would never be checked.
    for page in PAGES:
        text = page.read_text()
        checked = {expected for language, _, expected in runnable_blocks(text) if language == "python"}
        for match in FENCE.finditer(text):
            if _marked(text, match.start(), OUTPUT_MARK):
                assert match.group(2) in checked, f"{_rel(page)}: an output block after no runnable Python block"


def test_runnable_blocks_pair_code_with_its_output():
    text = "<!-- run -->\n```python\nprint(1)\n```\n\nIt prints:\n\n<!-- output -->\n```text\n1\n```\n" \
           "<!-- run -->\n```bash\nturnkv methods\n```\n```python\nnot run\n```\n"
    assert runnable_blocks(text) == [("python", "print(1)\n", "1\n"), ("bash", "turnkv methods\n", None)]


def test_the_readme_is_short_and_opens_with_its_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 150
    first_screen = "\n".join(lines[:30])
    assert "make chat" in first_screen and "make test" in first_screen


# Addresses a page may name that are not links: PyTorch's CPU wheel index, in the CPU-only install
# command (PyPI's Linux torch is the CUDA build, with its NVIDIA libraries).
PACKAGE_INDEXES = ("https://download.pytorch.org/whl/cpu",)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_pages_are_written_for_users(page):
    text = page.read_text()
    for index in PACKAGE_INDEXES:
        text = text.replace(index, "")
    assert not re.search(r"(?i)\bissues?\s*#?\d+|\(#\d+\)|#\d+\b", text), "an issue number"
    assert "in progress" not in text.lower()
    assert not re.search(r"\]\((?:https?:)?//", text) and "http://" not in text and "https://" not in text, \
        "a link outside the repository"
    assert "../shared" not in text and "shared/" not in text


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_quoted_paths_exist(page):
    # Every `benchmarks/...`, `turnkv/...`, `tests/...` or docs image the page names is in the repository.
    text = page.read_text()
    for path in re.findall(r"`((?:benchmarks|turnkv|tests|scripts)/[\w./{},-]+)`", text):
        for one in _expand(path.split(" ")[0]):
            assert (REPO / one).exists(), f"{_rel(page)} quotes {one}, which does not exist"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
        assert (page.parent / image).resolve().exists(), f"{_rel(page)} shows {image}, which does not exist"


def _expand(path: str) -> list[str]:
    """`a/{b,c}.json` -> a/b.json, a/c.json."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path.rstrip(".,")]
    return [one for part in match.group(1).split(",") for one in _expand(path[: match.start()] + part + path[match.end():])]


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]' (make test installs it)")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_plots_come_from_the_committed_json(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import plots
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    written = plots.draw(tmp_path)
    assert sorted(p.name for p in written) == sorted(plots.SOURCES)
    for name in plots.SOURCES:
        assert (REPO / "docs" / "img" / name).exists(), f"docs/img/{name}: run python benchmarks/plots.py"


def test_the_headline_lserve_preset_is_the_recipe_of_the_committed_run():
    from turnkv.methods.recipe import preset

    run = json.loads((REPO / "benchmarks/decode/results/h100-llama-3.1-8b-engine-path/speed.json").read_text())
    assert str(preset("lserve-random")) == run["recipes"]["lserve prefill=streaming_heads(pattern=random)"]


MARKED = [page for page in PAGES if runnable_blocks(page.read_text())]


def test_the_readme_and_getting_started_have_runnable_examples():
    assert {"README.md", "docs/getting-started.md"} <= {_rel(p) for p in MARKED}


@pytest.mark.slow
@pytest.mark.parametrize("page", MARKED, ids=_rel)
def test_marked_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for language, code, expected in runnable_blocks(page.read_text()):
        if language == "python":
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"{_rel(page)} block", "exec"), namespace)  # noqa: S102  (the page's own example)
            if expected is not None:
                assert _lines(printed.getvalue()) == _lines(expected), \
                    f"{_rel(page)}: the block printed\n{printed.getvalue()}\nwhere the page shows\n{expected}"
        elif language == "bash":
            for line in code.splitlines():
                command = line.split("#", 1)[0].strip()
                if not command:
                    continue
                argv = shlex.split(command)
                assert argv[0] == "turnkv", f"runnable shell blocks run turnkv commands: {command}"
                run = subprocess.run([sys.executable, "-m", "turnkv.cli", *argv[1:]], capture_output=True,
                                     text=True, timeout=600, check=False,
                                     env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
                assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
        else:
            pytest.fail(f"{_rel(page)}: a runnable block in {language!r}; python and bash run")


def _lines(text: str) -> list[str]:
    """The text's lines without trailing blanks, and without blank lines at its ends."""
    return [line.rstrip() for line in text.strip("\n").splitlines()]
