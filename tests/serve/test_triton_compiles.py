"""The compile watcher the server's slow-phase log reads: it chains onto Triton's post-compile hook."""

import pytest

from turnkv import triton_compiles

triton = pytest.importorskip("triton")


class _Info:
    def __init__(self, name):
        self.name = name


def test_the_watcher_names_each_compile_once_and_keeps_the_previous_hook(monkeypatch):
    from triton import knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(triton_compiles, "_installed", False)
    assert triton_compiles.watch() and triton_compiles.watch()  # installed once, however often asked
    triton_compiles.take()
    hook = knobs.runtime.jit_post_compile_hook
    hook(key=None, repr="", fn=_Info("_chunk_attention"), compile={}, is_manual_warmup=False, already_compiled=False)
    hook(key=None, repr="", fn=_Info("_decode_chunk"), compile={}, is_manual_warmup=False, already_compiled=False)
    assert triton_compiles.take() == ["_chunk_attention", "_decode_chunk"]
    assert triton_compiles.take() == []
    assert seen == ["_chunk_attention", "_decode_chunk"]  # the hook that was there still runs


def test_tritons_jit_calls_the_hook_with_the_keywords_the_watcher_takes():
    """No kernel compiles on a CPU (the interpreter never calls the hook), so this reads the call."""
    import inspect
    from triton.runtime import jit
    source = inspect.getsource(jit.JITFunction._call_hook)
    for keyword in ("key=", "repr=", "fn=", "compile=", "is_manual_warmup=", "already_compiled="):
        assert keyword in source
