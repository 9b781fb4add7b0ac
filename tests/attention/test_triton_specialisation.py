"""Kernels launched with shapes that change while a server runs must not compile a new variant per
shape: their run-time integers are listed in do_not_specialize (Triton otherwise specialises an
integer on being 1 or a multiple of 16, a compile of seconds in the middle of a step)."""

import pytest

triton = pytest.importorskip("triton")


def _integers(kernel):
    """The kernel's arguments that are neither pointers nor constexprs (compiled or interpreted)."""
    import inspect
    fn = getattr(kernel, "fn", kernel)
    return [name for name, p in inspect.signature(fn).parameters.items()
            if not name.endswith("_ptr") and "constexpr" not in str(p.annotation)]


def _unspecialised(kernel) -> set:
    kwargs = getattr(kernel, "kwargs", None)  # TRITON_INTERPRET=1: the jit decorator's arguments
    return set(kwargs.get("do_not_specialize", ()) if kwargs is not None else kernel.do_not_specialize)


def test_the_page_expansion_specialises_on_no_integer():
    from turnkv.attention.triton.page_select import _expand_pages
    assert set(_integers(_expand_pages)) == _unspecialised(_expand_pages)


@pytest.mark.parametrize("module, name, varying", [
    ("turnkv.attention.triton.chunk_prefill", "_chunk_attention", ["T", "num_blocks_m", "num_splits", "window", "sink"]),
    ("turnkv.attention.triton.chunk_prefill", "_merge_splits", ["rows", "T", "num_splits"]),
    ("turnkv.attention.triton.decode", "_decode_chunk", ["window", "num_splits"]),
    ("turnkv.kv.head_write", "_write_heads", ["T"]),
    ("turnkv.attention.triton.page_fold", "_fold_runs", ["T", "NH"]),
])
def test_lengths_and_split_counts_are_not_specialised_on(module, name, varying):
    import importlib
    kernel = getattr(importlib.import_module(module), name)
    assert set(varying) <= _unspecialised(kernel)
