"""Natural-English filler text without a download: the documentation strings of Python's standard
library and of a few installed packages, cleaned of anything that looks like code.

Modules are walked in sorted order, and so are their classes, functions and methods, so the corpus
is the same in every process of one environment (it changes with the Python and package versions).
Paragraphs keep only prose sentences: no digits, so the numbers the tasks plant are never ambiguous,
and no identifiers, markup or examples.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import random
import re
import sys
import warnings
from functools import lru_cache

WORDS_PER_TOKEN = 0.75  # the estimate when no tokenizer is given

# Installed with turnkv's own dependencies (numpy, and through torch and rouge-score the others);
# any that is missing is skipped.
PACKAGES = ("jinja2", "networkx", "nltk", "numpy")
# Modules never imported: they open windows or browsers, print, write files, or only hold tests and demos.
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "ensurepip", "venv",
         "lib2to3", "pydoc_data", "distutils", "readline", "rlcompleter", "site", "sitecustomize", "usercustomize",
         "app", "book", "draw", "gui", "twitter"}
_CODE_LINE = (" ", "\t", ">>>", "...", ":", "..", "-", "*", "+", "=", "|", "#")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_NOT_PROSE = re.compile(r"\d|`|\w\(|_|\w\.\w|[A-Z]{3}|[{}\[\]<>=*#@$%^&|\\/~\"]|--|\be\.g\.$|\bi\.e\.$")


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens in `text`: counted by the tokenizer when given, else estimated at 0.75 words a token."""
    if not text:
        return 0
    if tokenizer is None:
        return round(len(text.split()) / WORDS_PER_TOKEN)
    try:
        return len(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return len(tokenizer.encode(text))


def _module_names(roots: list[str], depth: int = 2) -> list[str]:
    names = []
    for root in roots:
        try:
            module = importlib.import_module(root)
        except BaseException:  # noqa: BLE001 - platform modules, missing extras, SystemExit in scripts
            continue
        names.append(root)
        if depth and hasattr(module, "__path__"):
            subs = sorted(info.name for info in pkgutil.iter_modules(module.__path__))
            names += _module_names([f"{root}.{s}" for s in subs if not (s.startswith("_") or s in _SKIP
                                                                          or "test" in s or "demo" in s)], depth - 1)
    return names


def _docstrings(module_name: str) -> list[str]:
    module = sys.modules[module_name]
    docs = [inspect.getdoc(module)]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        docs.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            docs += [inspect.getdoc(member) for key, member in sorted(vars(obj).items())
                     if not key.startswith("_") and (inspect.isfunction(member) or inspect.ismethoddescriptor(member))]
    return [d for d in docs if d]


def clean_paragraphs(doc: str, min_words: int = 12) -> list[str]:
    """The prose paragraphs of one docstring: code-like paragraphs dropped, code-like sentences removed."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = block.strip("\n").split("\n")
        if any(line.startswith(_CODE_LINE) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        sentences = [s for s in _SENTENCE.split(text)
                     if s[:1].isupper() and s.endswith(".") and len(s.split()) >= 4 and not _NOT_PROSE.search(s)]
        if sum(len(s.split()) for s in sentences) >= min_words:
            out.append(" ".join(sentences))
    return out


@lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """Every prose paragraph, deduplicated, in a fixed order."""
    stdlib = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _SKIP)
    paragraphs: dict[str, None] = {}
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        for name in _module_names(stdlib) + _module_names(list(PACKAGES)):
            for doc in _docstrings(name):
                paragraphs.update(dict.fromkeys(clean_paragraphs(doc)))
    return tuple(paragraphs)


def sentences(paragraph: str) -> list[str]:
    return _SENTENCE.split(paragraph)


class Filler:
    """Draws filler paragraphs for one instance: runs of consecutive corpus paragraphs from random
    starts, never the same paragraph twice within the instance (until the corpus runs out)."""

    def __init__(self, rng: random.Random, tokenizer=None):
        self.rng, self.tokenizer = rng, tokenizer
        self.paragraphs = corpus()
        self.used: set[int] = set()
        self.separator = max(0, count_tokens("a\n\na", tokenizer) - 2 * count_tokens("a", tokenizer))

    def take(self, n_tokens: int, min_paragraphs: int = 2) -> list[str]:
        """Paragraphs whose joined text has about `n_tokens` tokens; the last one is cut at a sentence
        boundary to land near the budget, and one is split when fewer than `min_paragraphs` come out."""
        out, total = [], 0
        index = self.rng.randrange(len(self.paragraphs))
        misses = 0
        while n_tokens - total > 8 and misses < 50:
            if len(self.used) >= len(self.paragraphs):
                self.used.clear()
            while index in self.used:
                index = (index + 1) % len(self.paragraphs)
            self.used.add(index)
            paragraph = self.paragraphs[index]
            index = (index + 1) % len(self.paragraphs)
            room = n_tokens - total - (self.separator if out else 0)
            kept = self._fit(paragraph, room)
            if kept is None:
                misses += 1
                continue
            out.append(kept)
            total += count_tokens(kept, self.tokenizer) + (self.separator if len(out) > 1 else 0)
            if kept != paragraph:
                break
        while 0 < len(out) < min_paragraphs:  # split the longest paragraph in two
            i = max(range(len(out)), key=lambda j: len(sentences(out[j])))
            parts = sentences(out[i])
            if len(parts) < 2:
                break
            half = len(parts) // 2
            out[i : i + 1] = [" ".join(parts[:half]), " ".join(parts[half:])]
        return out

    def _fit(self, paragraph: str, room: int) -> str | None:
        """The paragraph, or its longest run of leading sentences within `room` tokens (None if none)."""
        if count_tokens(paragraph, self.tokenizer) <= room:
            return paragraph
        kept = []
        for sentence in sentences(paragraph):
            if count_tokens(" ".join(kept + [sentence]), self.tokenizer) > room:
                break
            kept.append(sentence)
        return " ".join(kept) if kept else None


def document(filler: Filler, n_tokens: int, facts: list[str], rng: random.Random) -> str:
    """A filler document of about `n_tokens` tokens with each fact sentence planted at a random sentence
    boundary of a random paragraph (facts stand as their own paragraphs when there is no filler)."""
    tokenizer = filler.tokenizer
    fact_tokens = sum(count_tokens(f, tokenizer) + 1 for f in facts)
    paragraphs = [sentences(p) for p in filler.take(max(0, n_tokens - fact_tokens))]
    if not paragraphs:
        return "\n\n".join(facts)
    for fact in facts:
        parts = rng.choice(paragraphs)
        parts.insert(rng.randint(0, len(parts)), fact)
    return "\n\n".join(" ".join(parts) for parts in paragraphs)
