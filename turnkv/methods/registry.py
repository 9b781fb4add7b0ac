"""Every method turnkv knows, by axis and name, so recipes can be written as strings and listed."""

from __future__ import annotations

import dataclasses
import inspect

from turnkv.errors import InvalidRequestError

AXES = ("prefill", "scorer", "allocator", "turns", "decode", "state")
REGISTRY: dict[str, dict[str, type]] = {axis: {} for axis in AXES}


def register(axis: str, name: str):
    """Class decorator: make a dataclass available as `name` on `axis`."""

    def wrap(cls):
        cls.name = name
        REGISTRY[axis][name] = cls
        return cls

    return wrap


def build(axis: str, name: str, params: dict | None = None):
    """Instantiate a component, with errors that list what exists."""
    _load_all()
    options = REGISTRY[axis]
    if name not in options:
        raise InvalidRequestError(f"unknown {axis} {name!r}; choose one of: {', '.join(sorted(options))}")
    cls = options[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(params or {}) - fields
    if unknown:
        raise InvalidRequestError(
            f"{axis} {name!r} has no parameter {sorted(unknown)[0]!r}; its parameters: {', '.join(sorted(fields)) or 'none'}"
        )
    try:
        return cls(**(params or {}))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{axis} {name!r}: {e}") from None


def describe() -> list[dict]:
    """One entry per component: axis, name, parameters with defaults, and the first docstring line."""
    _load_all()
    rows = []
    for axis in AXES:
        for name, cls in sorted(REGISTRY[axis].items()):
            params = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
            doc = (inspect.getdoc(cls) or "").splitlines()[0] if cls.__doc__ else ""
            rows.append({"axis": axis, "name": name, "params": params, "doc": doc})
    return rows


def _load_all() -> None:
    # Importing the package registers every component file.
    import turnkv.methods  # noqa: F401
