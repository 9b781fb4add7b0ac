"""Paths a user gives (options, arguments, environment variables), read as a shell would read them."""

from __future__ import annotations

import os
from pathlib import Path


def user_path(path: str | os.PathLike) -> Path:
    """`path` with environment variables ($VAR, ${VAR}) and a leading ~ or ~user expanded; a path
    without them is returned as it is (relative paths stay relative)."""
    return Path(os.path.expanduser(os.path.expandvars(os.fspath(path))))
