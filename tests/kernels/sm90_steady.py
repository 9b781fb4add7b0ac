"""The kernels of a serving step at the sizes that change from step to step (batch size, chunk
length, kept history, table width): cases for sm90.py, whose compile records must show one compile
per constexpr setting. A compile that only a new size caused would run mid-serving, on the worker
thread, while every running stream waits (about a second each on an H100)."""

from __future__ import annotations

from sm90_cases import BF16, FP32, I64, MODELS, PAGE, SMS, _window_scores, e, z

from turnkv.attention.triton import chunk_prefill, decode, radix_top_k
from turnkv.kv import head_write

CASES = {}
LLAMA = MODELS["llama8b"]
BATCHES = (1, 2, 3, 5, 17, 64)
HISTORIES = (100, 3333, 32768, 129536)  # kept tokens per head: tables of odd and even widths


def _decode(B: int, length: int):
    H, D = LLAMA.kv_heads, LLAMA.head_dim
    splits = decode.choose_splits(B * H, length, SMS)
    pages = 64
    decode.indexed_decode(e(B, LLAMA.heads, D), e(pages, PAGE, D), e(pages, PAGE, D), z(B, H, -(-length // PAGE)),
                          z(B, H), splits)


def _chunk(T: int, history: int):
    H, D = LLAMA.kv_heads, LLAMA.head_dim
    length = history + T
    block_m = chunk_prefill.launch_config(BF16, D)["block_m"]
    splits = chunk_prefill.choose_splits(H, -(-LLAMA.group * T // block_m), length, SMS)
    q = e(1, T, LLAMA.heads + 2 * H, D)[:, :, : LLAMA.heads].transpose(1, 2)
    chunk_prefill.chunk_attention(q, e(64, PAGE, D), e(64, PAGE, D), z(1, H, -(-length // PAGE), dtype=I64),
                                  z(1, H, dtype=I64), splits)


def _write(T: int):
    kv = e(1, T, 2 * LLAMA.kv_heads, LLAMA.head_dim)
    head_write.write_heads(kv[:, :, : LLAMA.kv_heads], kv[:, :, LLAMA.kv_heads :], z(LLAMA.kv_heads * T),
                           e(64, PAGE, LLAMA.head_dim), e(64, PAGE, LLAMA.head_dim))


CASES["steady/decode"] = lambda: [_decode(B, n) for B in BATCHES for n in HISTORIES]
CASES["steady/chunk"] = lambda: [_chunk(T, n) for T in (17, 64, 100, 512, 2048) for n in HISTORIES]
CASES["steady/write_heads"] = lambda: [_write(T) for T in (1, 17, 32, 48, 100, 2048)]
# LoopServe's re-selection in an eager step: any batch, over capacities of any page count.
CASES["steady/window_scores"] = lambda: [_window_scores(LLAMA, False, capacity=c, B=B) for B in (1, 3, 17)
                                         for c in (8192, 32768, 33024)]
# Rows per query head or per KV head, of any batch (8 and 24 rows are not multiples of 16); each a
# capacity wide: whole pages, so the row stride keeps its alignment.
CASES["steady/radix_top_k"] = lambda: [radix_top_k.top_k_ascending(e(R, n, dtype=FP32), 1024)
                                       for R in (8, 24, 32, 96, 544) for n in (32768, 33024, 131072)]
