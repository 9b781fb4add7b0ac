"""Radix select (turnkv/attention/triton/radix_top_k.py) against torch.topk + sort, and the one-program
kernel for short rows, timed as CUDA-graph replays; each checked against a stable sort.

    python benchmarks/gpu_top_k.py     # H100: ~1 min
"""
import sys, torch
sys.path.insert(0, ".")
from turnkv.attention.triton import radix_top_k as R, top_k as S

def graphed(fn, reps=50):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3

def ref(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values

torch.manual_seed(0)
for rows, n, k in ((32, 131072, 1024), (8, 131072, 1024), (32, 32768, 1024), (32, 2048, 63)):
    x = torch.rand(rows, n, device="cuda").pow(6)
    x[:, -100:] = float("-inf"); x[:, :4] = float("inf")
    ok = torch.equal(R.top_k_ascending(x, k), ref(x, k))
    t_r = graphed(lambda: R.top_k_ascending(x, k))
    t_t = graphed(lambda: x.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values)
    extra = ""
    if n <= S.MAX_ROW:
        extra = f"  one-program {graphed(lambda: S.top_k_ascending(x, k)):6.1f} us"
    for chunk in (2048, 4096):
        extra += f"  radix chunk {chunk} {graphed(lambda: R.top_k_ascending(x, k, chunk=chunk)):6.1f} us"
    print(f"[{rows}, {n}] k={k}: exact {ok}  radix {t_r:6.1f} us  torch topk+sort {t_t:6.1f} us{extra}")
