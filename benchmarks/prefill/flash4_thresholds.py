"""turnkv.attention.flash (FlashAttention-4 through turnkv's adapter) on the GPU, Llama-3.1-8B's attention
shape (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages):
- check: the adapter against reference.paged_chunk (fp32) for even and uneven heads, one to three
  sequences, 1 to 2048 new tokens, and flash.causal against reference.causal_prefill; the paged
  Triton kernel's error beside it;
- host: host time per call (200 calls issued back to back) against the GPU time, for a 64-token chunk;
- thresholds: the paged kernel (split as the engine splits it) against flash.paged for 64 to 4096 new
  tokens over 8K, 32K and 128K, and fresh causal chunks of 256 to 16384 tokens against torch's flash
  attention and cuDNN (its plan cached). These set flash.takes_chunk and flash.takes_fresh.

    python3 benchmarks/prefill/flash4_thresholds.py benchmarks/prefill/results/h100-flash4/thresholds.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import time_cuda  # noqa: E402
from turnkv.attention import flash, reference  # noqa: E402
from turnkv.attention.triton import chunk_prefill  # noqa: E402

Hq, H, D, G = 32, 8, 128, 4
DT = torch.bfloat16
rows = []


def pool(lengths_bh, page, gen):
    flat = [n for row in lengths_bh for n in row]
    per = [(n + page - 1) // page for n in flat]
    total = sum(per) + 3
    perm = torch.randperm(total, generator=gen).cuda()
    k = torch.randn(total, page, D, device="cuda", dtype=DT)
    v = torch.randn(total, page, D, device="cuda", dtype=DT)
    B, Hh = len(lengths_bh), len(lengths_bh[0])
    table = torch.zeros(B, Hh, max(per), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(per):
        table.view(B * Hh, -1)[i, :n] = perm[at:at + n].int()
        at += n
    lengths = torch.tensor(lengths_bh, dtype=torch.int64, device="cuda")
    return k, v, table, lengths


def check(gen):
    for B, T, uneven in ((1, 512, False), (1, 37, True), (2, 300, True), (3, 1, True), (1, 2048, True)):
        base = [[T + (977 * (b + 1) + 131 * h if uneven else 4000) for h in range(H)] for b in range(B)]
        k, v, table, lengths = pool(base, 16, gen)
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
        ref = reference.paged_chunk(q.float(), k.float(), v.float(), table, lengths)
        got = flash.paged(q, k, v, table, lengths)
        err = (got.float() - ref).abs().max().item()
        kern = chunk_prefill.chunk_attention(q, k, v, table, lengths, num_splits=2)
        err_k = (kern.float() - ref).abs().max().item()
        rows.append(dict(check=f"paged B={B} T={T} uneven={uneven}", flash_err=err, kernel_err=err_k,
                         layout=str(got.stride())))
        print(rows[-1], flush=True)
    for B, T in ((1, 1000), (2, 333), (1, 1)):
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=DT)
        kv = torch.randn(B, T, 2, H, D, device="cuda", dtype=DT)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        qt = q.transpose(1, 2)
        try:
            ref = reference.causal_prefill(qt.float(), k.float(), v.float())
            got = flash.causal(qt, k, v)
            rows.append(dict(check=f"causal B={B} T={T}", flash_err=(got.float() - ref).abs().max().item(),
                             layout=str(got.stride())))
        except Exception as e:
            rows.append(dict(check=f"causal B={B} T={T}", error=repr(e)[:300]))
        print(rows[-1], flush=True)


def host_cost(gen):
    k, v, table, lengths = pool([[8192 + 64] * H], 16, gen)
    q = torch.randn(1, 64, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
    qc = torch.randn(1, 64, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
    kc = torch.randn(1, 64, H, D, device="cuda", dtype=DT).transpose(1, 2)
    calls = {
        "flash.paged 64/8K": lambda: flash.paged(q, k, v, table, lengths),
        "kernel 64/8K": lambda: chunk_prefill.chunk_attention(q, k, v, table, lengths, num_splits=8),
        "flash.causal 64": lambda: flash.causal(qc, kc, kc),
        "sdpa flash causal 64": lambda: F.scaled_dot_product_attention(qc, kc, kc, is_causal=True, enable_gqa=True),
    }
    for name, fn in calls.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        gpu = time_cuda(fn)
        rows.append(dict(host=name, host_us=host * 1e6, gpu_us=gpu * 1e6))
        print(rows[-1], flush=True)


def thresholds(gen):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for L in (8192, 32768, 131072):
        k, v, table, lengths = pool([[L + 4096] * H], 16, gen)
        for T in (64, 128, 256, 384, 512, 1024, 4096):
            lens = lengths.clone()
            lens.fill_(L + T)
            q = torch.randn(1, T, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
            splits = chunk_prefill.choose_splits(H, -(-G * T // 128), L + T, sms)
            tk = time_cuda(lambda: chunk_prefill.chunk_attention(q, k, v, table, lens, num_splits=splits))
            tf = time_cuda(lambda: flash.paged(q, k, v, table, lens))
            flops = 4 * Hq * D * (T * L + T * (T + 1) / 2)
            rows.append(dict(cell=f"{T} over {L}", kernel_ms=tk * 1e3, flash_ms=tf * 1e3,
                             kernel_tflops=flops / tk / 1e12, flash_tflops=flops / tf / 1e12,
                             fills=flash.fills_gpu(q.device, H, T * G)))
            print(rows[-1], flush=True)
        del k, v
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for T in (256, 1024, 4096, 8192, 16384):
        q = torch.randn(1, T, Hq, D, device="cuda", dtype=DT).transpose(1, 2)
        kv = torch.randn(1, T, 2, H, D, device="cuda", dtype=DT)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ts = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            tc = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        tf = time_cuda(lambda: flash.causal(q, k, v))
        rows.append(dict(cell=f"fresh {T}", sdpa_flash_ms=ts * 1e3, cudnn_cached_ms=tc * 1e3, flash_ms=tf * 1e3))
        print(rows[-1], flush=True)


if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    print("usable", flash.usable(torch.device("cuda"), DT, D), flush=True)
    for part in (check, host_cost, thresholds):
        try:
            part(gen)
        except Exception as e:
            import traceback
            traceback.print_exc()
            rows.append(dict(part=part.__name__, error=repr(e)[:400]))
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
