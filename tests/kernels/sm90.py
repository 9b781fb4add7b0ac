"""Compile Triton kernels for an H100 (sm_90) on a machine without a GPU: the subprocess entry of
test_sm90_compile.py.

    python tests/kernels/sm90.py [--cases FILE] [--shard I/N] [--only NAME ...]

FILE (default sm90_cases.py beside this one) defines CASES, a dict name -> function of no arguments
that launches kernels the way the engine does: through its Python wrappers, on CPU tensors of the
engine's shapes. Under `sm90()` every launch compiles for real (JITFunction.run: Triton's frontend,
the MLIR passes and ptxas, to a cubin for sm_90a) and then runs nothing: a stand-in for Triton's
CUDA driver reports an H100 and its launcher does nothing. Loading the kernel still checks its shared
memory and threads per block against the H100's limits, as on the GPU.

Triton's interpreter must be off (TRITON_INTERPRET unset): under it @triton.jit gives interpreted
functions, which accept code the compiler rejects. This process therefore refuses to run with it set.

Output, on stdout: one JSON object per case, {"case", "ok", "error", "seconds", "compiled"}, where
compiled lists the kernels compiled (or loaded from Triton's cache) as "module.kernel[constexprs]".
The exit status is 0 when every case compiled, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("sm90.py compiles kernels: run it with TRITON_INTERPRET unset")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

# An H100 SXM as Triton's CUDA driver and torch.cuda describe it (the limits Triton checks at load).
H100 = dict(max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
            sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120)
TARGET = GPUTarget("cuda", 90, 32)
MAX_THREADS = 1024  # threads per block


class _NoLaunch:
    """The launcher Triton builds per compiled kernel (CudaLauncher's interface): runs nothing."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        return None


class _Utils:
    def get_device_properties(self, device):
        return dict(H100)

    def load_binary(self, name, kernel, shared, device):
        """(module, function, registers, spills, max threads per block): the module is never loaded."""
        assert kernel, f"{name}: no cubin"
        return 0, 0, 0, 0, MAX_THREADS


class FakeH100Driver:
    """Triton's active driver for the compile run: target sm_90, device 0, stream 0."""

    def __init__(self):
        self.utils = _Utils()
        self.launcher_cls = _NoLaunch

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return (TARGET.arch // 10, TARGET.arch % 10)

    def get_active_torch_device(self):
        return torch.device("cpu")


CUDA = torch.device("cuda", 0)


def _on_cuda(fn):
    """fn(device, ...) answered as for CUDA device 0, whatever device the wrapper passes."""
    def call(device, *args, **kwargs):
        return fn(CUDA, *args, **kwargs)
    return call


@contextlib.contextmanager
def sm90():
    """Triton compiles for an H100 and launches nothing; the engine's device-dependent choices answer
    as on an H100: torch.cuda's queries report one, and the functions that decide by a tensor's device
    (PDL's launch options, the skinny matmul's default setting) are asked about cuda:0. Restored on exit."""
    from turnkv.model.triton import gemv, pdl

    props = SimpleNamespace(multi_processor_count=H100["multiprocessor_count"], name="NVIDIA H100 (stand-in)",
                            major=TARGET.arch // 10, minor=TARGET.arch % 10)
    default_config = gemv.default_config
    patches = [
        mock.patch("torch.cuda.get_device_capability", lambda device=None: (props.major, props.minor)),
        mock.patch("torch.cuda.get_device_properties", lambda device=None: props),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.is_current_stream_capturing", lambda: False),
        mock.patch.object(pdl, "launch_options", _on_cuda(pdl.launch_options)),
        mock.patch.object(gemv, "default_config",
                          lambda M, N, K, device, dtype=torch.bfloat16: default_config(M, N, K, CUDA, dtype)),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.callback(setattr, driver, "_active", driver._active)  # None: no driver chosen yet
        driver.set_active(FakeH100Driver())
        yield


def _record(compiled: list[str]):
    """A jit_post_compile_hook that appends "module.kernel[constexprs; warps, stages, pointer dtypes]"
    to `compiled`."""
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        names = fn.jit_function.arg_names
        consts = ", ".join(f"{names[k[0]] if len(k) == 1 else k}={v!r}" for k, v in compile["constants"].items())
        pointers = ",".join(sorted({t[1:] for t in compile["signature"].values() if t.startswith("*")}))
        compiled.append(f"{fn.module.rsplit('.', 1)[-1]}.{fn.name}[{consts}; warps={compile['num_warps']}, "
                        f"stages={compile['num_stages']}, pointers={pointers}]")
    return hook


def _messages(e: BaseException) -> str:
    """The exception and its causes, innermost last, without stack frames: a CompilationError names
    the kernel's source line, its cause what the compiler rejected."""
    parts = []
    while e is not None:
        parts.append("".join(traceback.format_exception_only(e)).strip())
        e = e.__cause__ or e.__context__
    return "\n--- caused by ---\n".join(parts)


def run_case(name: str, fn) -> dict:
    compiled: list[str] = []
    start = time.perf_counter()
    error = None
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = _record(compiled)
    try:
        with sm90():
            fn()
    except Exception as e:  # a compile error, or resources beyond the H100's, fails the case
        error = _messages(e)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    if error is None and not compiled:
        error = "the case compiled no kernel"
    return dict(case=name, ok=error is None, error=error, seconds=round(time.perf_counter() - start, 2),
                compiled=compiled)


def load_cases(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.CASES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=Path, default=Path(__file__).with_name("sm90_cases.py"))
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th")
    parser.add_argument("--only", nargs="*", default=None, help="case names")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    cases = load_cases(args.cases)
    names = list(cases) if args.only is None else args.only
    if args.list:
        print("\n".join(names))
        return 0
    index, count = (int(x) for x in args.shard.split("/"))
    ok = True
    for name in names[index::count]:
        result = run_case(name, cases[name])
        ok &= result["ok"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
