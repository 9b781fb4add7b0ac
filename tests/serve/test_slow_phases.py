"""The slow-phase log's sources: the compile watcher (chained onto Triton's post-compile hook) and each
thread's CPU time."""

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


def test_each_threads_cpu_seconds_are_read_by_name():
    import threading
    import time

    from turnkv.serve.slow_phases import thread_cpu_seconds
    done = threading.Event()

    def burn():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            sum(range(1000))
        done.wait(10)

    thread = threading.Thread(target=burn, name="busy-probe")
    thread.start()
    time.sleep(0.05)
    while thread.is_alive() and thread_cpu_seconds().get("busy-probe", 0.0) < 0.25:
        time.sleep(0.05)
    cpu = thread_cpu_seconds()
    done.set()
    thread.join()
    assert cpu["busy-probe"] >= 0.25 and "MainThread" in cpu


def test_the_worker_profile_is_written_where_the_environment_says(monkeypatch, tmp_path):
    import pstats

    from turnkv.serve.slow_phases import profiled_worker

    def work():
        return sum(range(10000))

    monkeypatch.setenv("TURNKV_WORKER_PROFILE", str(tmp_path / "worker.prof"))
    with profiled_worker():
        work()
    names = {name for (_, _, name) in pstats.Stats(str(tmp_path / "worker.prof")).stats}
    assert "work" in names
    monkeypatch.delenv("TURNKV_WORKER_PROFILE")
    with profiled_worker():  # no file asked for: nothing profiled, nothing written
        work()
