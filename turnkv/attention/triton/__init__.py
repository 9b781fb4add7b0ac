"""Triton kernels for the GPU path. Each has a reference in turnkv/attention/reference.py and is
tested against it on the GPU and, at small shapes, on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations


def available() -> bool:
    """Whether Triton imports here (the kernels run on CUDA, or on CPU in interpreter mode)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
