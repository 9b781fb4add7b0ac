"""Programmatic dependent launch (PDL) for the decode step's chain of kernels, on Hopper and newer.

A decode step is a few hundred small kernels, one after another. With PDL a kernel is launched
while its predecessor drains; each program first waits (griddepcontrol.wait, `gdc_wait`) until the
predecessor has finished and its writes are visible, so nothing is read or written early. What it
saves is the launch gap between the two, also inside a CUDA graph (benchmarks/sparse/README.md).

A kernel that takes part has a `GDC: tl.constexpr` argument and calls `enter(GDC, ...)` first
thing, before any load or store, in every program: the chain's order then holds transitively (a
kernel cannot finish before the one it waits on). Its launch adds `**launch_options(device)`.

Off below compute capability 9, under Triton's interpreter, and with TURNKV_PDL=0 in the
environment (read at import) or `ENABLED = False`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("TURNKV_PDL", "1") != "0"
# Kernels launched with early=True (norms, RoPE, the K/V write, SiLU, decode attention and its merge)
# also signal right after their wait that the next kernel may launch (gdc_launch_dependents). The
# next kernel starts once every program has signalled, that is in the signalling kernel's last wave.
# The selection kernels (page scores, top-k, window scores, radix select) do not signal early, which
# would slow LServe's selection down, nor does the skinny matmul, which gains nothing from it
# (benchmarks/sparse/README.md).
EARLY_TRIGGER = os.environ.get("TURNKV_PDL_EARLY", "1") != "0"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device, early: bool = False) -> dict:
    """The GDC flag and the launch option of a kernel launched on `device`; early: the kernel also
    takes the EARLY flag (signal the next launch right after the wait). The one place where PDL
    depends on the device: on only for CUDA devices of compute capability 9 or more (griddepcontrol
    is a Hopper instruction) and never under Triton's interpreter (no such launch there), so the CPU
    tests run every kernel with GDC off."""
    on = ENABLED and not _INTERPRETED and device.type == "cuda" and _supported(device.index or 0)
    options = {"GDC": on, "launch_pdl": True} if on else {"GDC": False}
    if early:
        options["EARLY"] = on and EARLY_TRIGGER
    return options


@triton.jit
def enter(GDC: tl.constexpr, EARLY: tl.constexpr):
    """A taking-part kernel's first statement: wait until the previous kernel is done and its writes
    are visible (gdc_wait), then, with EARLY, let the next kernel launch (gdc_launch_dependents).
    Nothing when GDC is off."""
    if GDC:
        gdc_wait()
        if EARLY:
            gdc_launch_dependents()
