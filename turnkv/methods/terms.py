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


def format_term(component) -> str:
    """A registered component -> its term, naming only the parameters that differ from the defaults."""
    values = {f.name: getattr(component, f.name) for f in fields(component) if f.init}
    defaults = {f.name: f.default for f in fields(component) if f.init}
    changed = [f"{k}={v}" for k, v in values.items() if v != defaults[k]]
    return component.name + (f"({','.join(changed)})" if changed else "")
