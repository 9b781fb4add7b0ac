"""Paged chunk attention on the GPU: a chunk of new tokens over a long kept history, one layer call at
Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages).

Methods, all over the same page pool and page tables (equal head lengths: the chunk attends to
history + itself, causal from the bottom right):
- kernel:      turnkv/attention/triton/chunk_prefill.py, reading the pages in place (split as the
               engine splits it);
- sdpa_gather: today's engine path: gather K/V pages (reference.gather_pages) + SDPA with a bottom-right
               causal mask (reference.causal_suffix);
- sdpa_only:   the same SDPA call on K/V already contiguous (the attention alone, no gather);
- split:       the engine's path for long chunks over long histories (attention/chunk.py
               split_history): the history gathered and attended, every key visible, and the chunk
               over itself, causal, both by cuDNN, merged by their log-sum-exp in one Triton pass;
- flex:        torch's FlexAttention (compiled) over the pool itself with a BlockMask built from the
               page tables. Flex's key blocks are 128 tokens, so the benchmark's pool hands each head
               its pages in runs of 8 consecutive pages (128 slots) in shuffled order: the layout Flex
               needs, which the other methods read through their 16-token page tables as any other;
- hf:          transformers' SDPA attention (integrations.sdpa_attention) on a contiguous cache, with
               its DynamicCache append (torch.cat of history and chunk), under the mask masking_utils
               builds (once per forward: not timed; with a mask its GQA repeats K/V).
The floor of a cell is max(FLOPs / measured bf16 matmul rate, bytes / measured copy bandwidth), with
FLOPs = 4 * Hq * D * (T * history + T (T + 1) / 2) (causal cells only) and bytes = K/V read once plus
q and the output; `of_floor` = floor / time.

First a correctness check: uneven heads, partial last pages, int8 / fp8 pools, split and unsplit,
against reference.paged_chunk in fp32; then each cell's methods against the kernel.

    python3 benchmarks/prefill/chunk_attention.py --out benchmarks/prefill/results/h100_chunk_attention.json
    python3 benchmarks/prefill/chunk_attention.py --sweep   # kernel launch settings and split counts
    python3 benchmarks/prefill/chunk_attention.py --smoke   # tiny shapes, CPU interpreter allowed

The table is printed last; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPE = dict(Hq=32, H=8, D=128, page=16, flex_block=128)
SMOKE_SHAPE = dict(Hq=4, H=2, D=32, page=4, flex_block=16)
SMOKE_TILES = dict(block_m=16, block_n=16, num_warps=2, num_stages=1)
METHODS = ("kernel", "sdpa_gather", "sdpa_only", "split", "flex", "hf")
SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
         for m, n, w, st in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 2), (128, 32, 4, 3),
                             (64, 64, 4, 3)]]
SWEEP_SPLITS = (1, 2, 3, 4, 8, 16, 32)


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/prefill/results/h100_chunk_attention.json")
    ap.add_argument("--chunks", default="64,512,4096", help="new tokens per chunk")
    ap.add_argument("--histories", default="8192,32768,131072", help="kept tokens per head before the chunk")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which the remaining cells skip FlexAttention (a compile per cell)")
    ap.add_argument("--sweep", action="store_true",
                    help="launch settings and split counts in every cell of --chunks x --histories")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU under TRITON_INTERPRET=1")
    return ap.parse_args()


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

import triton  # noqa: E402
import triton.testing  # noqa: E402

from turnkv.attention import chunk, reference  # noqa: E402
from turnkv.attention.triton import chunk_prefill as kernel  # noqa: E402

# ---- inputs -------------------------------------------------------------------------------------

class Cell:
    """T new tokens over `history` kept ones in every head of one layer's pool [pages, page, D]. Head h
    owns pages [h * per_head, (h + 1) * per_head), handed out in runs of flex_block / page pages in a
    shuffled order: table [1, H, per_head] (int64, as the engine's)."""

    def __init__(self, T, history, shape, dtype, device, seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.T, self.history, self.shape = T, history, shape
        Hq, H, D, page, fb = shape["Hq"], shape["H"], shape["D"], shape["page"], shape["flex_block"]
        self.length = history + T
        run = fb // page
        self.runs = -(-self.length // fb)  # flex blocks per head
        per_head = self.runs * run
        self.order = torch.stack([torch.randperm(self.runs, generator=gen) for _ in range(H)])  # [H, runs]
        pages = self.order[:, :, None] * run + torch.arange(run)  # [H, runs, run] within the head's region
        table = pages.reshape(H, per_head) + torch.arange(H)[:, None] * per_head
        self.table = table[None].to(device)
        self.lengths = torch.full((1, H), self.length, dtype=torch.int64, device=device)
        data = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: 128K heads are large
        self.k = torch.randn(H * per_head, page, D, generator=data, device=device, dtype=dtype)
        self.v = torch.randn(H * per_head, page, D, generator=data, device=device, dtype=dtype)
        self.q = torch.randn(1, T, Hq, D, generator=data, device=device, dtype=dtype).transpose(1, 2)
        self.per_head = per_head

    def flops(self) -> float:
        Hq, D, T = self.shape["Hq"], self.shape["D"], self.T
        return 4.0 * Hq * D * (T * self.history + T * (T + 1) / 2)

    def bytes(self) -> float:
        Hq, H, D, T = self.shape["Hq"], self.shape["H"], self.shape["D"], self.T
        size = self.k.element_size()
        return (2 * H * self.length * D + 2 * Hq * T * D) * size


# ---- methods ------------------------------------------------------------------------------------

def splits_for(cell: Cell, device, config=None, scale_splits=1.0) -> int:
    if device.type != "cuda":
        return 2
    launch = kernel.launch_config(cell.q.dtype, cell.shape["D"], config)
    G = cell.shape["Hq"] // cell.shape["H"]
    blocks = -(-G * cell.T // launch["block_m"])
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    base = kernel.choose_splits(cell.shape["H"], blocks, cell.length, sms)
    return max(1, round(base * scale_splits))


def run_kernel(cell: Cell, device, config=None, splits=None):
    splits = splits or splits_for(cell, device, config)
    return lambda: kernel.chunk_attention(cell.q, cell.k, cell.v, cell.table, cell.lengths, splits, config=config)


def run_sdpa_gather(cell: Cell):
    def call():
        keys = reference.gather_pages(cell.k, cell.table, cell.length)
        values = reference.gather_pages(cell.v, cell.table, cell.length)
        return reference.causal_suffix(cell.q, keys, values)
    return call


def run_split(cell: Cell):
    def call():
        keys = reference.gather_pages(cell.k, cell.table, cell.length)
        values = reference.gather_pages(cell.v, cell.table, cell.length)
        h = cell.history
        return chunk.split_history(cell.q, keys[:, :, :h], values[:, :, :h], keys[:, :, h:], values[:, :, h:])
    return call


def run_sdpa_only(cell: Cell):
    keys = reference.gather_pages(cell.k, cell.table, cell.length)
    values = reference.gather_pages(cell.v, cell.table, cell.length)
    return lambda: reference.causal_suffix(cell.q, keys, values)


def run_flex(cell: Cell, device, compiled):
    """flex_attention over the pool as [1, H, per_head * page, D] (each head its region) with a BlockMask
    over logical 128-key blocks mapped to their physical runs: full blocks below every row's diagonal,
    masked blocks on it (mask_mod maps a physical slot back to its entry index)."""
    from torch.nn.attention.flex_attention import BlockMask

    Hq, H, D, page, fb = (cell.shape[k] for k in ("Hq", "H", "D", "page", "flex_block"))
    G, T, hist = Hq // H, cell.T, cell.history
    k = cell.k.view(1, H, cell.per_head * page, D)
    v = cell.v.view(1, H, cell.per_head * page, D)
    # entry[h, slot]: the entry index of a physical slot of head h's region, minus the history (all slots
    # hold entries 0..runs * fb - 1; those at or past the length are masked by the causal rule anyway).
    # Row q sees entry[h, slot] <= q. A tensor, not a captured int: the compiled call does not
    # specialise on the history.
    entry = torch.empty(H, cell.runs * fb, dtype=torch.int64, device=device)
    logical = torch.arange(cell.runs * fb, device=device).view(cell.runs, fb)
    order = cell.order.to(device)
    for h in range(H):
        entry[h].view(cell.runs, fb)[order[h]] = logical - hist

    nq = -(-T // fb)
    q_lo = torch.arange(nq, device=device) * fb
    q_hi = torch.clamp(q_lo + fb, max=T) - 1
    n_full = (hist + q_lo + 1) // fb  # key blocks every row of the q block sees in full
    n_end = -(-(hist + q_hi + 1) // fb)
    j = torch.arange(cell.runs, device=device)
    phys = order[torch.arange(Hq, device=device) // G]  # [Hq, runs]: physical run of each logical block
    full_idx = phys[:, None, :].expand(Hq, nq, cell.runs).contiguous()  # blocks [0, n_full): in order
    part_pos = (j[None, :] + n_full[:, None]).clamp(max=cell.runs - 1)  # [nq, runs]: blocks [n_full, n_end)
    part_idx = torch.gather(phys[:, None, :].expand(Hq, nq, cell.runs), 2, part_pos[None].expand(Hq, nq, cell.runs))
    block_mask = BlockMask.from_kv_blocks(
        (n_end - n_full).to(torch.int32)[None, None].expand(1, Hq, nq).contiguous(),
        part_idx[None].to(torch.int32).contiguous(),
        n_full.to(torch.int32)[None, None].expand(1, Hq, nq).contiguous(), full_idx[None].to(torch.int32),
        BLOCK_SIZE=(fb, fb), mask_mod=lambda b, hq, qi, kv: entry[hq // G, kv] <= qi,
        seq_lengths=(T, cell.per_head * page))
    return lambda: compiled(cell.q, k, v, block_mask=block_mask, enable_gqa=True)


def run_hf(cell: Cell):
    """transformers' attention for a later turn: the cache grows by torch.cat (DynamicLayer.update), the
    mask comes from masking_utils.sdpa_mask, sdpa_attention_forward runs SDPA (repeating K/V for GQA)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    G = cell.shape["Hq"] // cell.shape["H"]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = G, True
    full_k = reference.gather_pages(cell.k, cell.table, cell.length)
    full_v = reference.gather_pages(cell.v, cell.table, cell.length)
    past_k, new_k = full_k[:, :, : cell.history].contiguous(), full_k[:, :, cell.history :].contiguous()
    past_v, new_v = full_v[:, :, : cell.history].contiguous(), full_v[:, :, cell.history :].contiguous()
    q = cell.q.contiguous()
    # Built once per forward and shared by the layers: outside the timed layer call.
    mask = sdpa_mask(1, cell.T, cell.length, q_offset=cell.history, device=q.device)

    def call():
        keys, values = torch.cat([past_k, new_k], dim=-2), torch.cat([past_v, new_v], dim=-2)
        return sdpa_attention_forward(module, q, keys, values, mask)[0].transpose(1, 2)
    return call


# ---- timing and rates ---------------------------------------------------------------------------

def bench(fn, device, rep_ms=100) -> float:
    """Milliseconds per call: triton's do_bench (CUDA events, median) on a GPU, wall clock otherwise."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rates(device) -> dict:
    """Measured bf16 matmul rate (FLOP/s, 8192^3) and copy bandwidth (bytes read + written per s, 2 GiB)."""
    if device.type != "cuda":
        return dict(matmul_flops=1e11, copy_bytes=1e10)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm = bench(lambda: a @ b, device, 300)
    src = torch.empty(2**30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    cp = bench(lambda: dst.copy_(src), device, 300)
    return dict(matmul_flops=2 * 8192**3 / (mm * 1e-3), copy_bytes=2 * src.numel() * 2 / (cp * 1e-3))


def relative_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# ---- parts --------------------------------------------------------------------------------------

def correctness(shape, dtype, device, config):
    """The kernel against reference.paged_chunk (fp32 query) on uneven heads, partial last pages,
    quantized pools and split counts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "attention"))
    from test_chunk_prefill import make_case

    Hq, H, D, page = shape["Hq"], shape["H"], shape["D"], shape["page"]
    G = Hq // H
    small = device.type != "cuda"
    cases = [(9, 37), (20, 70)] if small else [(64, 5003), (512, 3001), (700, 700)]
    rows = []
    for T, history in cases:
        lengths = [history + T - 3 * h for h in range(H)]
        for kv in (None, "int8", "fp8"):
            q, pool, table, lengths_t, _, _ = make_case(1, H, G, D, page, lengths, T, dtype, kv=kv, device=device)
            scales = {n: pool[n] for n in ("k_scale", "v_scale") if n in pool}
            ref = reference.paged_chunk(q.float(), pool["k"], pool["v"], table, lengths_t, **scales)
            for splits in (1, 3):
                out = kernel.chunk_attention(q, pool["k"], pool["v"], table, lengths_t, splits, config=config, **scales)
                err = relative_error(out, ref)
                rows.append(dict(T=T, history=history, kv=kv or "none", splits=splits, rel_err=err, ok=err < 1e-2))
                print(f"check T={T} history={history} kv={kv or 'none'} splits={splits} rel_err={err:.1e}", flush=True)
    return rows


def time_cell(T, history, shape, dtype, device, config, methods, rate, compiled, rep_ms, skip=()):
    cell = Cell(T, history, shape, dtype, device)
    floor_s = max(cell.flops() / rate["matmul_flops"], cell.bytes() / rate["copy_bytes"])
    row = dict(T=T, history=history, splits=splits_for(cell, device, config), flops=cell.flops(), bytes=cell.bytes(),
               floor_ms=floor_s * 1e3, ms={}, of_floor={}, rel_err_vs_kernel={}, errors={})
    out = run_kernel(cell, device, config)()
    for name in methods:
        if name in skip:
            row["errors"][name] = "skipped: past --budget"
            continue
        try:
            fn = {"kernel": lambda: run_kernel(cell, device, config), "sdpa_gather": lambda: run_sdpa_gather(cell),
                  "sdpa_only": lambda: run_sdpa_only(cell), "split": lambda: run_split(cell),
                  "flex": lambda: run_flex(cell, device, compiled),
                  "hf": lambda: run_hf(cell)}[name]()
            if name != "kernel":
                row["rel_err_vs_kernel"][name] = relative_error(fn(), out)
            ms = bench(fn, device, rep_ms)
            row["ms"][name], row["of_floor"][name] = ms, floor_s * 1e3 / ms
        except Exception as e:  # a peer that cannot run a cell (memory, compile) loses that cell only
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({k: row[k] for k in ("T", "history", "splits", "floor_ms", "ms", "errors")}), flush=True)
    return row


def sweep(shape, dtype, device, rep_ms, cells):
    rows = []
    for T, history in cells:
        cell = Cell(T, history, shape, dtype, device)
        for config in SWEEP:
            for splits in SWEEP_SPLITS[:2] if device.type != "cuda" else SWEEP_SPLITS:
                try:
                    ms = bench(run_kernel(cell, device, config, splits), device, rep_ms)
                except Exception as e:  # out of shared memory or registers
                    ms = None
                    print(f"{config}: {type(e).__name__}", flush=True)
                rows.append(dict(T=T, history=history, config=config, splits=splits, ms=ms,
                                 auto_splits=splits_for(cell, device, config)))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("needs a CUDA GPU (or --smoke for the interpreter at tiny shapes)")
    smoke = args.smoke
    shape = SMOKE_SHAPE if smoke else SHAPE
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter's bf16 dots are wrong
    config = SMOKE_TILES if smoke else None
    rep_ms = 20 if smoke else 100
    started = time.perf_counter()
    result = dict(device=torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, triton=triton.__version__, shape=shape, dtype=str(dtype),
                  config=kernel.launch_config(dtype, shape["D"], config), smoke=smoke)
    print(f"device {result['device']}  torch {torch.__version__}  triton {triton.__version__}  {shape} {dtype}",
          flush=True)
    result["correctness"] = correctness(shape, dtype, device, config)
    if not all(r["ok"] for r in result["correctness"]):
        print("CORRECTNESS CHECK FAILED: timings below are of a wrong kernel", flush=True)
    result["rates"] = rates(device)

    if args.sweep:
        cells = [(8, 40)] if smoke else [(T, h) for h in map(int, args.histories.split(","))
                                         for T in map(int, args.chunks.split(","))]
        result["sweep"] = sweep(shape, dtype, device, rep_ms, cells)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        # Static shapes: one compile per cell, each like the first (no dynamic-shape recompiles); past
        # Dynamo's recompile limit flex would fall back to its unfused eager path, so the limit is raised.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        compiled = flex_attention if device.type != "cuda" else torch.compile(flex_attention, dynamic=False)
        methods = [m for m in args.methods.split(",") if m]
        chunks = [8, 24] if smoke else [int(x) for x in args.chunks.split(",")]
        histories = [40, 100] if smoke else [int(x) for x in args.histories.split(",")]
        result["cells"] = []
        for h in histories:
            for T in chunks:
                skip = ("flex",) if time.perf_counter() - started > args.budget else ()
                result["cells"].append(time_cell(T, h, shape, dtype, device, config, methods, result["rates"],
                                                 compiled, rep_ms, skip))
    result["seconds"] = time.perf_counter() - started

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print()
    r = result["rates"]
    print(f"correctness: {sum(c['ok'] for c in result['correctness'])}/{len(result['correctness'])} ok, "
          f"max rel err {max(c['rel_err'] for c in result['correctness']):.1e}; matmul "
          f"{r['matmul_flops'] / 1e12:.0f} TFLOP/s, copy {r['copy_bytes'] / 1e9:.0f} GB/s")
    if "sweep" in result:
        for row in result["sweep"]:
            ms = f"{row['ms']:8.3f}" if row["ms"] is not None else f"{'fail':>8s}"
            print(f"T={row['T']:5d} history={row['history']:7d} splits={row['splits']:3d} {row['config']} {ms} ms")
    else:
        print("ms per layer call (all heads); in brackets: floor / time")
        print(f"{'new':>5s} {'history':>7s} {'floor ms':>9s} " + " ".join(f"{m:>18s}" for m in methods))
        for c in result["cells"]:
            cells = " ".join(f"{c['ms'][m]:9.3f} ({c['of_floor'][m]:4.2f})" if m in c["ms"] else f"{'fail':>18s}"
                             for m in methods)
            print(f"{c['T']:5d} {c['history']:7d} {c['floor_ms']:9.3f} {cells}")
        worst = [c for c in result["cells"] if "kernel" in c["ms"] and any(
            c["ms"][m] < c["ms"]["kernel"] for m in c["ms"] if m not in ("kernel", "sdpa_only"))]
        print(f"cells where a peer beats the kernel: {[(c['T'], c['history']) for c in worst]}")
        bad = {(c["T"], c["history"]): e for c in result["cells"] for e in [c["rel_err_vs_kernel"]]
               if any(v > 2e-2 for v in e.values())}
        if bad:
            print(f"PEERS DISAGREE WITH THE KERNEL: {bad}")
    print(f"wrote {out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main(ARGS)
