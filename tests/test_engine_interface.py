"""Nothing outside turnkv/engine/ reaches into LLM's private methods: Conversation, the server and the
benchmarks build their turns through `LLM.turn_parts` (turnkv/engine/turn_parts.py), the declared
interface. Read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE = REPO / "turnkv" / "engine"
SCANNED = (REPO / "turnkv", REPO / "benchmarks")


def private_methods(path: Path, class_name: str) -> set[str]:
    """Names of the methods `class_name` in `path` defines that start with one underscore."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("_") and not n.name.startswith("__")}


def calls_into(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every `x.<name>` in `source` with `name` among `names`, where x is not `self` or
    `cls` (a class's own private method of the same name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr in names
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((node.lineno, node.attr))
    return found


def test_the_check_sees_a_private_call():
    names = {"_token_tensor", "_kv_budget"}
    source = "def f(llm, conv):\n    llm._token_tensor([1])\n    conv.llm._kv_budget(None)\n    self._kv_budget(1)\n"
    assert calls_into(source, names) == [(2, "_token_tensor"), (3, "_kv_budget")]


def test_no_module_outside_the_engine_calls_a_private_llm_method():
    names = private_methods(ENGINE / "llm.py", "LLM")
    assert "_token_tensor" in names  # the engine's step loop uses it: private to the engine
    offenders = []
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            if ENGINE in path.parents:
                continue
            for line, name in calls_into(path.read_text(encoding="utf-8"), names):
                offenders.append(f"{path.relative_to(REPO)}:{line} calls LLM.{name}")
    assert offenders == [], "\n".join(offenders)
