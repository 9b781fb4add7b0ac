"""Which published code a scorer's keep rule follows: `compat` on every scorer that NVIDIA's kvpress
also ships. "authors" (the default) is the method authors' official code; "kvpress" is kvpress's
press of the same name, hyperparameter defaults included. A scorer lists the defaults that differ per
reading in a table; fields left at None take them."""

from __future__ import annotations

COMPATS = ("authors", "kvpress")


def resolve(component, defaults: dict[str, dict]) -> None:
    """Check `component.compat` and fill its None fields from defaults[compat]."""
    if component.compat not in COMPATS:
        raise ValueError(f"compat must be one of {', '.join(COMPATS)}")
    for name, value in defaults[component.compat].items():
        if getattr(component, name) is None:
            setattr(component, name, value)

