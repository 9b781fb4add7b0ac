"""Shared system prompts (turnkv/engine/prefix.py): memory, time to first token, compression calls.

Three measurements, one engine per setting:
  memory       C conversations open at once, all starting with the same P-token system prompt, T short
               turns each (recipe full): pool bytes against one copy of the prompt's KV plus the
               conversations' own pages.
  ttft         a new conversation's first turn with the prompt cached in the prefix index, against an
               engine without the index (prefix_cache=False), median of R.
  compressed   the same C x T under turns=flowkv(system=own) with snapkv budget=B: how many times the system
               prompt is compressed (Eviction.compress calls over positions [0, P)), and pool bytes.

Usage:
  python benchmarks/prefix/prefix_sharing.py                                  # CPU, embedded SmolLM2, 4K prompt
  python benchmarks/prefix/prefix_sharing.py --prefix 256 --conversations 4   # quick check
  python benchmarks/prefix/prefix_sharing.py --device cuda --shape llama-3.1-8b --prefix 32768 \\
      --dtype bfloat16 --kv-memory 40GiB --out benchmarks/prefix/results/h100_prefix_32k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import turnkv
from turnkv.methods.evict.eviction import Eviction

SENTENCE = "The harbour office keeps every ship's record, its cargo, its crew and the tides it sailed on. "
QUESTIONS = ["Which ship came in first today?", "And which one left last?", "Summarise the day.", "Thanks."]


def system_prompt(llm, tokens: int) -> str:
    """A system prompt whose rendering is about `tokens` tokens long."""
    per = len(llm.tokenizer.encode(SENTENCE))
    return SENTENCE * max(1, tokens // per)


def engine(args, **kwargs):
    model = args.shape or args.model
    return turnkv.LLM(model, device=args.device, dtype=args.dtype, kv_memory=args.kv_memory,
                      state_cpu_memory=0, **kwargs)


def sync(llm):
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def run_conversations(llm, system, args, recipe=None):
    convs, replies = [], []
    for i in range(args.conversations):
        conv = llm.conversation(system=system, recipe=recipe)
        for t in range(args.turns):
            message = f"{QUESTIONS[t % len(QUESTIONS)]} (client {i})"
            replies.append(conv.send(message, max_new_tokens=args.max_new_tokens, ignore_eos=True))
        convs.append(conv)
    return convs, replies


def prompt_copy_bytes(llm, prompt_tokens: int) -> int:
    """Bytes of one uncompressed copy of a prompt's KV in the pool: whole pages per layer and KV head."""
    pool = llm.pool
    return -(-prompt_tokens // pool.page_size) * pool.num_layers * pool.num_kv_heads * pool.page_bytes


def measure_memory(args, system):
    llm = engine(args, prefix_cache=True, prefix_cache_memory=args.kv_memory)
    t0 = time.perf_counter()
    convs, replies = run_conversations(llm, system, args)
    seconds = time.perf_counter() - t0
    system_tokens = convs[0].turns[0].system_end
    one_copy = prompt_copy_bytes(llm, system_tokens)
    own = sum(c.kv_sharing[0] for c in convs)
    pool_bytes = llm.pool.bytes_in_use()
    out = {"system_tokens": system_tokens, "conversations": len(convs), "turns": args.turns,
           "pool_bytes": pool_bytes, "one_prompt_copy_bytes": one_copy, "own_bytes": own,
           "shared_bytes": llm.pool.shared_bytes(), "index_bytes": llm.prefix_cache_bytes(),
           "pool_over_one_copy_plus_own": pool_bytes / (one_copy + own),
           "without_sharing_bytes_estimate": len(convs) * one_copy + own,
           "cached_tokens_first_turns": [r.cached_tokens for r in replies[:: args.turns]][:3], "seconds": seconds}
    for c in convs:
        c.close()
    return out, llm


def first_turn_ttft(llm, system, repeats: int, max_new_tokens: int) -> list[float]:
    times = []
    for i in range(repeats):
        conv = llm.conversation(system=system)
        sync(llm)
        reply = conv.send(f"{QUESTIONS[0]} (timing {i})", max_new_tokens=max_new_tokens, ignore_eos=True)
        times.append(reply.ttft_s)
        conv.close()
    return times


def measure_ttft(args, system, cached_llm):
    first_turn_ttft(cached_llm, system, 1, 2)  # the prompt is in the index (and the engine warm)
    cached = first_turn_ttft(cached_llm, system, args.repeats, 2)
    plain = engine(args, prefix_cache=False)
    first_turn_ttft(plain, system, 1, 2)  # warm-up
    uncached = first_turn_ttft(plain, system, args.repeats, 2)
    del plain
    return {"ttft_cached_s": cached, "ttft_uncached_s": uncached,
            "speedup_median": statistics.median(uncached) / statistics.median(cached)}


def measure_compressed(args, system):
    calls = []
    original = Eviction.compress

    def counting(self, kv, turns, lo, hi, window, inv_freq):
        calls.append((lo, hi))
        return original(self, kv, turns, lo, hi, window, inv_freq)

    Eviction.compress = counting
    try:
        llm = engine(args, prefix_cache=True, prefix_cache_memory=args.kv_memory)
        recipe = f"flowkv budget={args.budget} turns=flowkv(system=own)"
        convs, replies = run_conversations(llm, system, args, recipe)
        system_end = convs[0].turns[0].system_end
        out = {"recipe": str(convs[0].recipe), "conversations": len(convs), "compress_calls": len(calls),
               "system_prompt_compressions": sum(1 for lo, hi in calls if lo == 0 and hi == system_end),
               "pool_bytes": llm.pool.bytes_in_use(), "shared_bytes": llm.pool.shared_bytes(),
               "own_bytes": sum(c.kv_sharing[0] for c in convs),
               "compressed_prompt_bytes": sum(c.kv_sharing[1] for c in convs[:1]) * 2}
        for c in convs:
            c.close()
    finally:
        Eviction.compress = original
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2-135M)")
    p.add_argument("--shape", default=None, help="random weights of this shape instead (e.g. llama-3.1-8b)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-memory", default="4GiB")
    p.add_argument("--prefix", type=int, default=4096, help="system prompt tokens")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["memory", "ttft", "compressed"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    probe = engine(args, prefix_cache=False)
    system = system_prompt(probe, args.prefix)
    device = torch.cuda.get_device_name() if probe.device.type == "cuda" else "cpu"
    result = {"model": probe.name, "device": device, "dtype": str(probe.dtype).removeprefix("torch."),
              "args": vars(args)}
    del probe
    cached_llm = None
    if "memory" not in args.skip:
        result["memory"], cached_llm = measure_memory(args, system)
        print(json.dumps(result["memory"]), flush=True)
    if "ttft" not in args.skip:
        if cached_llm is None:
            cached_llm = engine(args, prefix_cache=True, prefix_cache_memory=args.kv_memory)
        result["ttft"] = measure_ttft(args, system, cached_llm)
        print(json.dumps(result["ttft"]), flush=True)
    del cached_llm
    if "compressed" not in args.skip:
        result["compressed"] = measure_compressed(args, system)
        print(json.dumps(result["compressed"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
