"""FlashAttention-4's Hopper forward (flash-attn-4, CuTe DSL) against turnkv's attention paths, one layer call
at Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16).

Cells:
- fresh causal T: FA4 dense causal against cuDNN SDPA and torch's flash SDPA;
- paged T over L: T new tokens over L kept (equal head lengths), read from turnkv's head-granular pool
  (16-token pages; each KV head a batch entry of FA4 with its own page table, its query group as heads,
  causal from the bottom right): FA4 paged against turnkv's chunk kernel; FA4 over 128-token pages (its
  TMA path) for scale.

Needs flash-attn-4 and its CUTLASS DSL wheels (`pip install turnkv[flash]`; on a machine without a
network, benchmarks/prefill/README.md says how they were carried).

    python3 benchmarks/prefill/flash4_cells.py --out benchmarks/prefill/results/h100-flash4/cells.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import time_cuda  # noqa: E402
from turnkv.attention.triton import chunk_prefill  # noqa: E402

Hq, H, D, G = 32, 8, 128, 4
DT = torch.bfloat16


def tflops(flops, s):
    return flops / s / 1e12


def fresh_cells(sizes, rows):
    from flash_attn.cute import flash_attn_func
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for T in sizes:
        q = torch.randn(1, T, Hq, D, device="cuda", dtype=DT)
        k = torch.randn(1, T, H, D, device="cuda", dtype=DT)
        v = torch.randn(1, T, H, D, device="cuda", dtype=DT)
        flops = 4 * Hq * D * T * (T + 1) / 2
        t0 = time.perf_counter()
        out_fa = flash_attn_func(q, k, v, causal=True)
        out_fa = out_fa[0] if isinstance(out_fa, tuple) else out_fa
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ref = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                ref[name] = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                s = time_cuda(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
            rows.append(dict(cell=f"fresh {T}", method=f"sdpa_{name}", ms=s * 1e3, tflops=tflops(flops, s)))
        err = (out_fa.transpose(1, 2).float() - ref["flash"].float()).abs().max().item()
        s = time_cuda(lambda: flash_attn_func(q, k, v, causal=True))
        rows.append(dict(cell=f"fresh {T}", method="fa4", ms=s * 1e3, tflops=tflops(flops, s), max_err=err,
                         first_call_s=first))
        print(rows[-3:], flush=True)


def paged_pool(lengths, page, gen):
    """A pool [pages, page, D] holding every head's entries in shuffled pages; tables [H, P]."""
    per_head = [(n + page - 1) // page for n in lengths]
    total = sum(per_head)
    perm = torch.randperm(total, generator=gen).cuda()
    k_cache = torch.randn(total, page, D, device="cuda", dtype=DT)
    v_cache = torch.randn(total, page, D, device="cuda", dtype=DT)
    P = max(per_head)
    table = torch.zeros(len(lengths), P, dtype=torch.int32, device="cuda")
    at = 0
    for h, n in enumerate(per_head):
        table[h, :n] = perm[at:at + n].int()
        at += n
    return k_cache, v_cache, table


def paged_cells(cells, rows, gen):
    from flash_attn.cute import flash_attn_varlen_func
    for T, L in cells:
        total_len = L + T
        lengths = torch.full((1, H), total_len, dtype=torch.int32, device="cuda")
        flops = 4 * Hq * D * (T * L + T * (T + 1) / 2)
        q = torch.randn(1, T, Hq, D, device="cuda", dtype=DT).transpose(1, 2)  # [B, Hq, T, D] view
        k16, v16, table16 = paged_pool([total_len] * H, 16, gen)
        splits = chunk_prefill.choose_splits(H, -(-G * T // 128), total_len,
                                             torch.cuda.get_device_properties(0).multi_processor_count)
        out_k = chunk_prefill.chunk_attention(q, k16, v16, table16[None], lengths, num_splits=splits)
        s = time_cuda(lambda: chunk_prefill.chunk_attention(q, k16, v16, table16[None], lengths, num_splits=splits))
        rows.append(dict(cell=f"paged {T} over {L}", method="turnkv_kernel", ms=s * 1e3, tflops=tflops(flops, s),
                         splits=splits))
        print(rows[-1], flush=True)
        # FA4: batch = KV heads, heads = the query group; q [H, T, G, D]
        qg = q[0].reshape(H, G, T, D).transpose(1, 2).contiguous()
        seqused = lengths[0].contiguous()
        for page, (kc, vc, tb) in ((16, (k16, v16, table16)), (128, paged_pool([total_len] * H, 128, gen))):
            for num_splits in (1, 0):
                name = f"fa4_page{page}_splits{'auto' if num_splits == 0 else num_splits}"
                try:
                    def call():
                        return flash_attn_varlen_func(qg, kc[:, :, None], vc[:, :, None], seqused_k=seqused,
                                                      page_table=tb, causal=True, num_splits=num_splits)
                    t0 = time.perf_counter()
                    o = call()
                    o = o[0] if isinstance(o, tuple) else o
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    if page == 16:
                        mine = out_k[0].reshape(H, G, T, D).transpose(1, 2)
                        err = (o.float() - mine.float()).abs().max().item()
                    else:
                        err = None
                    s = time_cuda(call)
                    rows.append(dict(cell=f"paged {T} over {L}", method=name, ms=s * 1e3, tflops=tflops(flops, s),
                                     max_err_vs_kernel=err, first_call_s=first))
                except Exception as e:  # a probe: record and go on
                    traceback.print_exc()
                    rows.append(dict(cell=f"paged {T} over {L}", method=name, error=repr(e)[:300]))
                print(rows[-1], flush=True)


def gathered_cells(cells, rows, gen):
    """FA4 over the pages gathered into contiguous runs first (flash.gathered, the copy timed with the
    call) against FA4 over the 16-token pages in place (flash.paged): T new tokens over L kept."""
    from turnkv.attention import flash
    for T, L in cells:
        total_len = L + T
        lengths = torch.full((1, H), total_len, dtype=torch.int32, device="cuda")
        flops = 4 * Hq * D * (T * L + T * (T + 1) / 2)
        q = torch.randn(1, T, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
        k16, v16, table16 = paged_pool([total_len] * H, 16, gen)
        table = table16[None]
        reference = flash.paged(q, k16, v16, table, lengths)
        gathered = functools.partial(flash.gathered, max_length=total_len)
        for name, fn in (("fa4_paged16", flash.paged), ("fa4_gathered16", gathered)):
            out = fn(q, k16, v16, table, lengths)
            err = (out.float() - reference.float()).abs().max().item()
            s = time_cuda(lambda: fn(q, k16, v16, table, lengths))  # noqa: B023 - timed right here
            rows.append(dict(cell=f"paged {T} over {L}", method=name, ms=s * 1e3, tflops=tflops(flops, s),
                             max_err_vs_paged=err))
            print(rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fresh", default="8192,32768")
    ap.add_argument("--paged", default="512x131072,512x32768,4096x32768,64x131072,32768x98304")
    ap.add_argument("--gathered", default="", help="cells for flash.gathered against flash.paged, e.g. 4096x32768")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    try:
        import flash_attn
        info["fa4"] = getattr(flash_attn, "__version__", "?")
    except Exception as e:
        info["fa4_import_error"] = repr(e)
    print(info, flush=True)
    try:
        fresh_cells([int(x) for x in a.fresh.split(",") if x], rows)
    except Exception:
        traceback.print_exc()
    cells = [tuple(int(v) for v in c.split("x")) for c in a.paged.split(",") if c]
    try:
        paged_cells(cells, rows, gen)
    except Exception:
        traceback.print_exc()
    try:
        gathered_cells([tuple(int(v) for v in c.split("x")) for c in a.gathered.split(",") if c], rows, gen)
    except Exception:
        traceback.print_exc()
    Path(a.out).write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    print(f"{'cell':26} {'method':26} {'ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['cell']:26} {r['method']:26} {r.get('ms', float('nan')):9.3f} {r.get('tflops', float('nan')):8.1f}"
              f" {r.get('max_err', r.get('max_err_vs_kernel', r.get('max_err_vs_paged', '')))}"
              f" {r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
