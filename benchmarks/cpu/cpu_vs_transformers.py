"""turnkv against transformers' generate on CPU, in one run, on the same model and tokens.

SmolLM2-135M-Instruct (the embedded GGUF, dequantized), fp32, greedy:
  1. a 2K-token prompt and 128 new tokens: TTFT and decode tokens/s for each, and their ratio;
  2. a second turn: turnkv prefills only the new turn against the kept KV, transformers re-prefills
     the whole history (it has no conversation state): TTFT of each.

Usage: python benchmarks/cpu/cpu_vs_transformers.py [--repeats 3] [--out benchmarks/cpu/results/cpu_vs_transformers]
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import turnkv
from turnkv.model.load import embedded_model_path


def natural_text(min_tokens: int, tokenizer) -> str:
    """English prose from docstrings that ship with Python, in a fixed order."""
    import collections
    import email
    import json as json_mod
    import logging
    import os
    import pathlib
    import string
    import textwrap
    import unittest

    parts = [inspect.getdoc(m) or "" for m in (collections, email, json_mod, logging, os, pathlib, string,
                                              textwrap, unittest, argparse, inspect, statistics)]
    text = "\n\n".join(p for p in parts if p)
    while len(tokenizer.encode(text)) < min_tokens:
        text += "\n\n" + text
    ids = tokenizer.encode(text)[:min_tokens]
    return tokenizer.decode(ids)


def hf_time(model, ids: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=2)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/cpu/results/cpu_vs_transformers")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    llm = turnkv.LLM(dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = llm.tokenizer
    ids = tok.encode(natural_text(args.prompt_tokens, tok))
    assert len(ids) == args.prompt_tokens, len(ids)
    prompt = torch.tensor([ids])

    # Correctness first: both engines give the same greedy tokens.
    ours = llm.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
    with torch.inference_mode():
        theirs = hf.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
    agree = sum(a == b for a, b in zip(ours, theirs))

    rows = {"turnkv": {"ttft": [], "tps": []}, "transformers": {"ttft": [], "tps": []}}
    for _ in range(args.repeats):
        r = llm.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True)
        rows["turnkv"]["ttft"].append(r.ttft_s)
        rows["turnkv"]["tps"].append(r.tokens_per_s)
        t1 = hf_time(hf, prompt, 1)
        tn = hf_time(hf, prompt, args.new_tokens)
        rows["transformers"]["ttft"].append(t1)
        rows["transformers"]["tps"].append((args.new_tokens - 1) / (tn - t1))

    # Second turn: a conversation whose first user message is the 2K-token document.
    question = "In one sentence, what is the first module described above about?"
    turn2 = {"turnkv": [], "transformers": []}
    history_tokens = new_turn_tokens = 0
    for _ in range(args.repeats):
        conv = llm.conversation()
        conv.send(natural_text(args.prompt_tokens, tok) + "\n\nSummarise this.", max_new_tokens=32, ignore_eos=True)
        reply = conv.send(question, max_new_tokens=1)
        turn2["turnkv"].append(reply.ttft_s)
        history = conv.tokens[: conv.turns[-1].prompt_end]
        history_tokens, new_turn_tokens = len(history), reply.prompt_tokens
        conv.close()
        turn2["transformers"].append(hf_time(hf, torch.tensor([history]), 1))

    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in rows.items()}
    t2 = {k: statistics.median(v) for k, v in turn2.items()}
    result = {
        "command": f"python benchmarks/cpu/cpu_vs_transformers.py --repeats {args.repeats}",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), float32, greedy",
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "greedy_agreement_first_16": f"{agree}/16",
        "single_turn": {"median": med, "all": rows,
                        "ttft_speedup": med["transformers"]["ttft"] / med["turnkv"]["ttft"],
                        "decode_speedup": med["turnkv"]["tps"] / med["transformers"]["tps"]},
        "second_turn": {"history_tokens": history_tokens, "new_turn_tokens": new_turn_tokens,
                        "median_ttft": t2, "all": turn2,
                        "ttft_speedup": t2["transformers"] / t2["turnkv"]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    s, t = result["single_turn"], result["second_turn"]
    md = [
        f"# turnkv vs transformers on CPU ({result['machine']['threads']} threads)",
        "", f"Command: `{result['command']}`", "",
        f"Model: {result['model']}. Medians of {args.repeats} runs. Greedy tokens agree: {agree}/16.", "",
        f"## {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens", "",
        "| engine | TTFT (s) | decode tok/s |", "|---|---|---|",
        f"| turnkv | {med['turnkv']['ttft']:.3f} | {med['turnkv']['tps']:.2f} |",
        f"| transformers generate | {med['transformers']['ttft']:.3f} | {med['transformers']['tps']:.2f} |",
        f"| **turnkv / transformers** | **{s['ttft_speedup']:.2f}x faster** | **{s['decode_speedup']:.2f}x faster** |",
        "", f"## Second turn ({history_tokens}-token history, {new_turn_tokens} new tokens)", "",
        "| engine | what it prefills | TTFT (s) |", "|---|---|---|",
        f"| turnkv | the new turn only, against kept KV | {t2['turnkv']:.3f} |",
        f"| transformers generate | the whole history | {t2['transformers']:.3f} |",
        f"| **speedup** | | **{t['ttft_speedup']:.1f}x** |", "",
    ]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
