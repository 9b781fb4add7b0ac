"""The text form of a component in a recipe string: `name` or `name(key=value, ...)`, values read as
bool, None, int, float or string."""

from __future__ import annotations

import re
from dataclasses import fields

from turnkv.errors import InvalidRequestError

_TERM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\((.*)\))?\s*$", re.S)


def split_top_level(text: str) -> list[str]:
    """Split at whitespace, ';' and ',' outside parentheses."""
    tokens, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and (ch.isspace() or ch in ";,"):
            if current:
                tokens.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise InvalidRequestError(f"unbalanced parentheses in recipe {text!r}")
    if current:
        tokens.append(current)
    return tokens


def split_recipe_list(text: str) -> list[str]:
    """"full,lserve prefill=streaming_heads(sink=16,local=64)" -> the two recipes: commas outside
    parentheses separate recipes (a command line's list of them)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            if text[start:i].strip():
                out.append(text[start:i].strip())
            start = i + 1
    return out


def parse_term(spec: str) -> tuple[str, dict]:
    """"name(key=value, ...)" -> (name with '-' read as '_', {key: value})."""
    match = _TERM.match(spec)
    if not match:
        raise InvalidRequestError(f"cannot read {spec!r}; write name or name(key=value, ...)")
    name, args = match.group(1).replace("-", "_"), match.group(2)
    params = {}
    for item in split_top_level(args or ""):
        if "=" not in item:
            raise InvalidRequestError(f"parameter {item!r} of {name} needs the form key=value")
        k, v = item.split("=", 1)
        params[k.strip()] = parse_value(v.strip())
    return name, params


def parse_value(text: str):
    """A parameter's text -> bool, None, int, float, or the text without quotes (non-strings pass)."""
    if not isinstance(text, str):
        return text
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip("'\"")


def default_values(component_or_class) -> dict:
    """The value each parameter takes when left out. A component with a `compat` field (which code
    its rule follows) resolves some defaults per reading: they are read off a fresh instance under
    the same reading (the class alone: the default reading)."""
    cls = component_or_class if isinstance(component_or_class, type) else type(component_or_class)
    defaults = {f.name: f.default for f in fields(cls) if f.init}
    if "compat" in defaults:
        compat = defaults["compat"] if cls is component_or_class else component_or_class.compat
        reference = cls(compat=compat)
        defaults = {k: v if k == "compat" else getattr(reference, k) for k, v in defaults.items()}
    return defaults


def format_term(component) -> str:
    """A registered component -> its term, naming only the parameters that differ from the defaults."""
    values = {f.name: getattr(component, f.name) for f in fields(component) if f.init}
    defaults = default_values(component)
    changed = [f"{k}={v}" for k, v in values.items() if v != defaults[k]]
    return component.name + (f"({','.join(changed)})" if changed else "")


def option_string(value) -> str:
    """A recipe key's value as the string form writes it (a component mapping as its term)."""
    if isinstance(value, dict):
        return component_string(value)
    return "none" if value is None else str(value)


def component_string(spec: dict) -> str:
    """{"scorer": "snapkv", "window": 16, "allocator": "adakv", "alpha": 0.3, "budget": 256} -> a string."""
    spec = dict(spec)
    if "scorer" in spec:  # an eviction block
        scorer, allocator = spec.pop("scorer"), spec.pop("allocator", "uniform")
        allocator_keys = {"alpha", "rule"}
        scorer_args = ",".join(f"{k}={v}" for k, v in spec.items() if k not in allocator_keys)
        allocator_args = ",".join(f"{k}={v}" for k, v in spec.items() if k in allocator_keys)
        return f"{scorer}({scorer_args})+{allocator}({allocator_args})"
    name = spec.pop("name")
    return f"{name}({','.join(f'{k}={v}' for k, v in spec.items())})"
