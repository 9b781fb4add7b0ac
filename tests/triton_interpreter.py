"""Triton's interpreter (TRITON_INTERPRET=1, how the kernels run in the tests without a GPU) reduces
with most combine functions one element at a time in Python, building a tensor per element; only
min, max, sum, argmin and argmax go to numpy. tl.sort and tl.topk compare and swap through xor_sum,
a reduction per bitonic stage, so a sort of a few thousand keys took tens of seconds. `install`
maps the bitwise combines of triton.language.standard (xor, or, and) to numpy's reductions, which
give the same integers."""

from __future__ import annotations

import numpy as np


def install() -> bool:
    """Route the interpreter's xor/or/and reductions to numpy; False when triton has no interpreter
    or its reduction class lacks what this relies on (the interpreter is then left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    ops = interpreter.ReduceOps
    combines = [(getattr(tl.standard, name, None), op) for name, op in
                (("_xor_combine", np.bitwise_xor), ("_or_combine", np.bitwise_or), ("_and_combine", np.bitwise_and))]
    combines = [(fn, op) for fn, op in combines if fn is not None]
    if not combines or getattr(ops.apply_impl, "numpy_bitwise", False) or not hasattr(ops, "to_tensor"):
        return False
    generic = ops.apply_impl

    def apply_impl(self, input):
        for fn, op in combines:
            if self.combine_fn == fn and len(input) == 1:
                data = input[0].handle.data
                return self.to_tensor(op.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
        return generic(self, input)

    apply_impl.numpy_bitwise = True
    ops.apply_impl = apply_impl
    return True
