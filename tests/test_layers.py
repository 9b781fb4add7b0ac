"""The package's import graph, read with `ast` (nothing is imported): no cycle between modules, layers
that only point down, and turnkv imports at module level.

Layers, lowest first: the top-level modules (turnkv/errors.py ...), model, attention, kv, methods,
state (the strategies between turns and their manager) and parallel (tensor parallelism's processes),
engine, serve and bench, then cli.py and the package's own __init__.py (the public facade: it re-exports the engine, so code inside the package
imports from the defining module instead). A module may import from its own layer or a lower one.

An edge is an import of a turnkv module: `import turnkv.x`, `from turnkv.x import y` (to the module
turnkv.x.y when that is one, else to turnkv.x) and relative imports. Imports under
`if TYPE_CHECKING:` never run and are not edges. Imports inside functions are edges too (they still
run, only later), and are allowed only for the modules that need an optional dependency.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "turnkv"

# Layer rank of a module: by its first package under turnkv/; top-level modules are rank 0.
LAYER_RANKS = {"model": 1, "attention": 2, "kv": 3, "methods": 4, "state": 5, "parallel": 5, "engine": 6, "serve": 7,
               "bench": 7, "cli": 8, "__main__": 8}  # __main__: `python -m turnkv`, the command line
FACADE_RANK = 8  # turnkv/__init__.py, beside cli.py at the top

# Modules a function may import: each needs an optional dependency, so importing it at module level
# would make every importer fail where that dependency is missing. A key covers the module and
# everything under it.
OPTIONAL_DEPENDENCY_MODULES = {
    "turnkv.attention.triton": "Triton kernels; triton is installed only on Linux x86_64",
    "turnkv.model.triton": "Triton kernels; triton is installed only on Linux x86_64",
    "turnkv.kv.head_write": "a Triton kernel; triton is installed only on Linux x86_64",
    "turnkv.kv.quant_write": "a Triton kernel; triton is installed only on Linux x86_64",
    "turnkv.serve.ray": "needs ray, the optional [ray] extra",
}
OPTIONAL_DEPENDENCIES = {"triton", "ray"}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. "turnkv.kv.pool"
    target: str  # imported turnkv module
    path: str  # the importing file, relative to the repository
    line: int
    in_function: bool


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root (a package's name maps to its
    __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, in_function) for every import statement that runs, skipping `if TYPE_CHECKING:` bodies."""
    stack = [(child, False) for child in reversed(tree.body)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        stack.extend((child, inside) for child in reversed(children))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_edges(root: Path, package: str, repo: Path) -> list[Edge]:
    """Every import of one of the package's modules by another, in file and line order."""
    modules = module_names(root, package)
    edges, seen = [], set()
    for source, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        rel = path.relative_to(repo).as_posix()
        for node, in_function in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    # relative: strip (level - 1) packages from the importing module's package
                    anchor = source.split(".") if is_package else source.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            for name in names:
                if name != package and not name.startswith(package + "."):
                    continue
                target = _resolve(name, modules)
                edge = Edge(source, target, rel, node.lineno, in_function)
                if target is not None and target != source and edge not in seen:
                    seen.add(edge)
                    edges.append(edge)
    return edges


def layer_rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return FACADE_RANK
    return LAYER_RANKS.get(parts[1], 0)


def layer_name(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "the package facade turnkv/__init__.py"
    return parts[1] if parts[1] in LAYER_RANKS else "top-level modules"


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle for each strongly connected component of more than one module."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack, stack, components = set(), [], []
    counter = 0
    for start in sorted(graph):  # Tarjan's algorithm, iterative
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    cycles = []
    for component in components:
        members, start = set(component), component[0]
        previous = {start: None}
        queue = deque([start])
        found = None
        while queue and found is None:  # breadth first: the shortest way from start back to it
            node = queue.popleft()
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    found = node
                    break
                if child not in previous:
                    previous[child] = node
                    queue.append(child)
        path = [found]
        while previous[path[-1]] is not None:
            path.append(previous[path[-1]])
        path.reverse()  # start ... found, and found imports start
        cycles.append([graph[a][b] for a, b in zip(path, path[1:] + [start])])
    return cycles


def _where(e: Edge) -> str:
    return f"{e.path}:{e.line}"


def cycle_violations(edges: list[Edge]) -> list[str]:
    out = []
    for cycle in find_cycles(edges):
        steps = " -> ".join(f"{e.source} ({_where(e)})" for e in cycle) + f" -> {cycle[0].source}"
        out.append(f"{_where(cycle[0])}: no cycle: {steps}")
    return out


def layer_violations(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        if layer_rank(e.target) > layer_rank(e.source):
            out.append(f"{_where(e)}: layers point down: {e.source} ({layer_name(e.source)}) imports "
                       f"{e.target} ({layer_name(e.target)}, a higher layer)")
    return out


def _optional(module: str) -> bool:
    return any(module == key or module.startswith(key + ".") for key in OPTIONAL_DEPENDENCY_MODULES)


def function_import_violations(edges: list[Edge]) -> list[str]:
    return [f"{_where(e)}: module-level imports: {e.source} imports {e.target} inside a function, and "
            f"{e.target} needs no optional dependency" for e in edges if e.in_function and not _optional(e.target)]


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(REPO / PACKAGE, PACKAGE, REPO)


def _fail(violations: list[str]):
    if violations:
        pytest.fail(f"{len(violations)} violation(s):\n" + "\n".join(violations), pytrace=False)


def test_no_import_cycle(edges):
    _fail(cycle_violations(edges))


def test_layers_point_down(edges):
    _fail(layer_violations(edges))


def test_turnkv_imports_at_module_level(edges):
    _fail(function_import_violations(edges))


def test_optional_dependency_allow_list_names_modules_that_need_one():
    """Each allow-list entry holds a module that imports triton or ray at module level."""
    modules = module_names(REPO / PACKAGE, PACKAGE)
    for key in OPTIONAL_DEPENDENCY_MODULES:
        covered = [m for m in modules if m == key or m.startswith(key + ".")]
        assert covered, f"{key} is not a module of the package"
        needs = []
        for m in covered:
            for node, in_function in _imports(ast.parse(modules[m].read_text(encoding="utf-8"))):
                if in_function:
                    continue
                if isinstance(node, ast.Import):
                    needs += [a.name.split(".")[0] for a in node.names]
                elif node.module and not node.level:
                    needs.append(node.module.split(".")[0])
        assert OPTIONAL_DEPENDENCIES & set(needs), f"nothing in {key} imports {sorted(OPTIONAL_DEPENDENCIES)}"


# ---- the checker itself, on a small package written here -------------------------------------

def _write(root: Path, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_checker_finds_cycles_layers_and_function_imports(tmp_path):
    root = tmp_path / "turnkv"
    _write(root, {
        "__init__.py": "",
        "errors.py": "",
        "model/__init__.py": "",
        "model/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from turnkv.kv import b\n",
        "kv/__init__.py": "",
        "kv/b.py": "from turnkv.kv import c\nimport turnkv.errors\n",
        "kv/c.py": "from . import d\n\ndef f():\n    from turnkv.model import a\n    import turnkv.kv.b\n",
        "kv/d.py": "from .b import x\nfrom ..model.a import y\n",
    })
    edges = import_edges(root, "turnkv", tmp_path)
    got = {(e.source, e.target, e.line, e.in_function) for e in edges}
    assert got == {
        ("turnkv.kv.b", "turnkv.kv.c", 1, False), ("turnkv.kv.b", "turnkv.errors", 2, False),
        ("turnkv.kv.c", "turnkv.kv.d", 1, False), ("turnkv.kv.c", "turnkv.model.a", 4, True),
        ("turnkv.kv.c", "turnkv.kv.b", 5, True),
        ("turnkv.kv.d", "turnkv.kv.b", 1, False), ("turnkv.kv.d", "turnkv.model.a", 2, False),
    }  # model/a.py's TYPE_CHECKING import is no edge
    cycles = find_cycles(edges)
    assert len(cycles) == 1 and {e.source for e in cycles[0]} in ({"turnkv.kv.b", "turnkv.kv.c"},
                                                                  {"turnkv.kv.b", "turnkv.kv.c", "turnkv.kv.d"})
    assert cycle_violations(edges)[0].startswith("turnkv/kv/b.py:1: no cycle: turnkv.kv.b (turnkv/kv/b.py:1) -> ")
    assert layer_violations(edges) == []
    assert function_import_violations(edges) == [
        "turnkv/kv/c.py:4: module-level imports: turnkv.kv.c imports turnkv.model.a inside a function, and "
        "turnkv.model.a needs no optional dependency",
        "turnkv/kv/c.py:5: module-level imports: turnkv.kv.c imports turnkv.kv.b inside a function, and "
        "turnkv.kv.b needs no optional dependency",
    ]
    up = [Edge("turnkv.model.a", "turnkv.kv.b", "turnkv/model/a.py", 3, False),
          Edge("turnkv.errors", "turnkv", "turnkv/errors.py", 1, False)]
    assert layer_violations(up) == [
        "turnkv/model/a.py:3: layers point down: turnkv.model.a (model) imports turnkv.kv.b (kv, a higher layer)",
        "turnkv/errors.py:1: layers point down: turnkv.errors (top-level modules) imports turnkv (the package "
        "facade turnkv/__init__.py, a higher layer)",
    ]
