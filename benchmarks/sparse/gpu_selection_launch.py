"""Launch settings of the decode over selected tokens / pages, end to end at 128K: loopserve-d and
lserve decode steps (graphed) with the selection lists' chunk count (17 default, or 33) and the
decode kernel's keys per tile (32, 64) and warps (2, 4) overridden. Prints ms per token and the
decode kernel's time per step (torch.profiler) per setting.

    python benchmarks/sparse/gpu_selection_launch.py     # H100: ~2 min
"""
import os, sys, time, collections, torch
sys.path.insert(0, "."); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turnkv
import gpu_decode_selection as S
from turnkv.attention import decode
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe
from torch.profiler import profile, ProfilerActivity
from turnkv.attention.triton import decode as K
import itertools
BASE = dict(K.DEFAULT_CONFIG)
ctx = 129536
llm = turnkv.LLM("llama-3.1-8b", dtype="bfloat16", device="cuda", kv_memory="40GiB", max_model_len=131072)
seq = SequenceKV(llm.pool)
llm.runner.prefill(seq, S.prompt(ctx, llm.config.vocab_size, ctx))
orig = decode.num_splits
OVERRIDE = [None]
def patched(device, bkh, max_len, kv_dtype=None):
    if bkh == 32 and OVERRIDE[0] is not None:
        return OVERRIDE[0]
    return orig(device, bkh, max_len, kv_dtype)
decode.num_splits = patched
rows = []
for name in ("loopserve-d", "lserve"):
    recipe = Recipe.parse(S.RECIPES[name])
    states = S.start(llm, recipe, [seq], ctx)
    for splits, bn, warps in [(None, None, None)] + list(itertools.product((None, 33), (32, 64), (2, 4))):
        OVERRIDE[0] = splits
        K.DEFAULT_CONFIG.clear(); K.DEFAULT_CONFIG.update(BASE)
        if bn is not None:
            K.DEFAULT_CONFIG.update(block_n=bn, num_warps=warps)
        if getattr(llm.runner.graphs, "selection", None) is not None:
            llm.runner.graphs.selection.close()
        tok = torch.full((1,), 7, device=llm.device)
        tok, _ = S.decode_steps(llm, recipe, [seq], states, tok, 8)
        torch.cuda.synchronize()
        n = 48
        t0 = time.perf_counter()
        tok, _ = S.decode_steps(llm, recipe, [seq], states, tok, n)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tok, _ = S.decode_steps(llm, recipe, [seq], states, tok, 16)
            torch.cuda.synchronize()
        tot = collections.Counter()
        for e in prof.events():
            if e.device_type.name == "CUDA":
                tot[e.name[:40]] += e.time_range.end - e.time_range.start
        print(f"{name:12s} splits {str(splits):5s} block_n {bn} warps {warps} wall {wall*1e3:.3f} ms/step  decode_chunk {tot['_decode_chunk']/16:.1f} us/step  merge {tot['_merge_chunks']/16:.1f}", flush=True)
    seq.truncate(ctx)
