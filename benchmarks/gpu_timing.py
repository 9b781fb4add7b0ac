"""GPU timing for the benchmark scripts: one call timed by CUDA events, and calls replayed from a CUDA graph.

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, from benchmarks/<topic>/
    from benchmarks.gpu_timing import time_cuda, time_graphed

time_cuda(fn, repeat=20, warmup=5) -> seconds of one fn() call.
    `warmup` untimed calls, a synchronize, then `repeat` timed calls:
    - by default each call between its own pair of CUDA events, waited on; the median of the `repeat`
      times (the upper of the two middle ones when `repeat` is even);
    - back_to_back=True: the `repeat` calls issued back to back between one pair of events; their mean.

time_graphed(fns, calls=20, repeat=20, warmup=5) -> seconds per call.
    fns: one callable, or a sequence of them to cycle through (e.g. one per copy of a weight, so that
    L2 holds none of them). Each fn is called once on the current stream and once on a side stream
    (the warm-up that capture needs: compiles, lazy initialisation, library workspaces), then one CUDA
    graph captures rounds = max(1, ceil(calls / len(fns))) passes over fns, i.e. rounds * len(fns)
    calls (`calls` when len(fns) divides it). time_cuda times graph.replay with `repeat`, `warmup`
    (replays) and `back_to_back`; the result is the replay's time over rounds * len(fns). No launch
    overhead between the calls, as in the engine's graphed decode step.

Every fn takes no arguments and runs on the current CUDA device and stream; what time_graphed captures
must be capturable (no host synchronisation, fixed shapes and addresses). device: where fn's work runs;
anything but CUDA (a CPU smoke run of a script's own code) gives no graph and no events: one call (one
pass over fns, divided by len(fns)) after the warm-up, timed by time.perf_counter, a figure without
meaning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch


def time_cuda(fn: Callable[[], object], repeat: int = 20, warmup: int = 5, *, back_to_back: bool = False,
              device: torch.device | str = "cuda") -> float:
    """Seconds of one fn() call: the median of `repeat` calls each between its own CUDA events, or with
    back_to_back the mean of `repeat` calls between one pair; after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if back_to_back:
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_graphed(fns: Callable[[], object] | Sequence[Callable[[], object]], calls: int = 20, repeat: int = 20,
                 warmup: int = 5, *, back_to_back: bool = False, device: torch.device | str = "cuda") -> float:
    """Seconds per call of about `calls` calls cycling through fns, replayed from one CUDA graph (the
    module's docstring gives the warm-up, the rounding of `calls` and the statistic)."""
    fns = [fns] if callable(fns) else list(fns)
    for fn in fns:
        fn()
    if torch.device(device).type != "cuda":
        return time_cuda(lambda: [fn() for fn in fns], warmup=0, device=device) / len(fns)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    rounds = max(1, math.ceil(calls / len(fns)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    return time_cuda(graph.replay, repeat, warmup, back_to_back=back_to_back) / (rounds * len(fns))
