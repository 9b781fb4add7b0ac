"""GPU smoke of every eviction scorer: exact kept counts and decode speed, with and without cuDNN attention.

Usage: python benchmarks/decode/gpu_eviction_smoke.py [nocudnn]   (llama-3.2-1b random weights, bf16, 8K prompt, 32 tokens)
"""
import torch
import time
import turnkv
import sys
if "nocudnn" in sys.argv:
    torch.backends.cuda.enable_cudnn_sdp(False)
llm = turnkv.LLM("llama-3.2-1b", dtype="bfloat16", device="cuda", kv_memory="8GiB")
ids = torch.randint(0, 32000, (8192,)).tolist()
for rec in ["full", "ada-snapkv budget=512", "snapkv budget=512", "h2o budget=512", "expected-attention budget=512",
            "pyramidkv budget=512", "streaming-llm budget=512", "tova budget=512", "knorm budget=512",
            "snapkv budget=512 schedule=decode every=16"]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = llm.generate(ids, recipe=rec, max_new_tokens=32, ignore_eos=True)
    torch.cuda.synchronize()
    print(f"{rec:45s} kv_tokens/(L*H)={r.kv_tokens/(16*8):8.1f} ttft={r.ttft_s:.3f}s tok/s={r.tokens_per_s:.1f} total={time.perf_counter()-t:.2f}s")
