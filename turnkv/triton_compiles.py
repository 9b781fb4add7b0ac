"""Which Triton kernels were compiled (or loaded from Triton's disk cache) in this process, so a slow
server step can say it waited for a compile. Triton calls `knobs.runtime.jit_post_compile_hook` once
per new specialization of a kernel (a new constexpr or integer-divisibility combination); `watch()`
chains onto that hook, and `take()` returns the kernels' names since the last take."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_names: list[str] = []
_installed = False


def _record(previous):
    def hook(*, fn, **kwargs):
        with _lock:
            _names.append(getattr(fn, "name", str(fn)))
        return previous(fn=fn, **kwargs) if previous else None
    return hook


def watch() -> bool:
    """Install the hook once per process; False when Triton is not installed."""
    global _installed
    try:
        from triton import knobs
    except ImportError:
        return False
    with _lock:
        if not _installed:
            knobs.runtime.jit_post_compile_hook = _record(knobs.runtime.jit_post_compile_hook)
            _installed = True
    return True


def take() -> list[str]:
    """Names of the kernels compiled since the last take, in order (a name repeats per specialization)."""
    with _lock:
        names = list(_names)
        _names.clear()
    return names
