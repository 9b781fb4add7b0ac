"""Sizes written as text (2GiB, 512MB) or given in bytes."""

from __future__ import annotations

import re

from turnkv.errors import InvalidRequestError

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that leaves at least 1 (1536 -> "1.5 KiB", 100 -> "100 B")."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def parse_bytes(size: int | str) -> int:
    """Bytes in `size`: an int, or a number with a unit (B, KB..TB in powers of 10, KiB..TiB in powers of 2)."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise InvalidRequestError(f"cannot read {size!r} as a size; write e.g. 2GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
