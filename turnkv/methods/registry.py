"""Every method turnkv knows, by kind and name, so recipes can be written as strings and listed.

There are four axes (turnkv.methods.protocols). Eviction is made of three kinds of component (a
scorer, an allocator and a turn policy); each other axis is one kind, named as the axis. Components
register by kind. Those of turnkv.methods register when that package is imported, which Python does
before any of its modules; the state strategies live in turnkv.state, a layer above, and register
when that package is imported (the engine does).
"""

from __future__ import annotations

import dataclasses
import inspect

from turnkv.errors import InvalidRequestError
from turnkv.methods.protocols import Allocator, Decode, Prefill, Scorer, StateStrategy, Turns
from turnkv.methods.terms import default_values

AXES = ("prefill", "eviction", "decode", "state")
# Each kind of component, the axis it belongs to, and the interface its classes derive from.
KINDS: dict[str, tuple[str, type]] = {
    "prefill": ("prefill", Prefill),
    "scorer": ("eviction", Scorer),
    "allocator": ("eviction", Allocator),
    "turns": ("eviction", Turns),
    "decode": ("decode", Decode),
    "state": ("state", StateStrategy),
}
REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str):
    """Class decorator: make a dataclass deriving from the kind's interface available as `name`."""
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    interface = KINDS[kind][1]

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, interface)):
            raise TypeError(f"{cls!r} registered as {kind} {name!r} must derive from {interface.__qualname__} "
                            f"(turnkv.methods.protocols)")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__qualname__} registered as {kind} {name!r} must be a dataclass (its fields "
                            f"are its parameters)")
        existing = REGISTRY[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; "
                             f"{cls.__module__}.{cls.__qualname__} needs another name")
        cls.name = name
        REGISTRY[kind][name] = cls
        return cls

    return wrap


def build(kind: str, name: str, params: dict | None = None):
    """Instantiate a component, with errors that list what exists."""
    options = REGISTRY[kind]
    if name not in options:
        raise InvalidRequestError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(options))}")
    cls = options[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(params or {}) - fields
    if unknown:
        raise InvalidRequestError(f"{kind} {name!r} has no parameter {sorted(unknown)[0]!r}; its parameters: "
                                  f"{', '.join(sorted(fields)) or 'none'}")
    try:
        return cls(**(params or {}))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{kind} {name!r}: {e}") from None


def describe() -> list[dict]:
    """One entry per component, in axis then kind order: its axis, kind, name, parameters with
    defaults, and the first paragraph of its docstring as one line."""
    rows = []
    for kind, (axis, _) in KINDS.items():
        for name, cls in sorted(REGISTRY[kind].items()):
            params = default_values(cls)
            doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split()) if cls.__doc__ else ""
            rows.append({"axis": axis, "kind": kind, "name": name, "params": params, "doc": doc})
    return rows
