"""Eviction methods under two turn policies on a ~4K-token multi-turn conversation: memory against
fidelity to the full-cache run, turn by turn.

Every recipe sees the same conversation: the user messages below, and as replies the full-cache run's
own greedy answers, fed by teacher forcing. Along each answer we compare the next-token distribution
with the full cache's: top-1 agreement with the full run's greedy token, and mean KL(full || method).

Usage: python benchmarks/quality/eviction_multiturn.py [--budgets 0.1,0.25,0.5] [--turns 4]
           [--methods snapkv,ada-snapkv,h2o,streaming-llm,pyramidkv] [--out benchmarks/quality/results/eviction_multiturn]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

from tqdm import tqdm

import turnkv
from turnkv.bench.metrics import greedy_agreement, mean_kl
from turnkv.methods.recipe import preset


def documents(tokenizer, count: int, tokens_each: int) -> list[str]:
    """Distinct passages of English prose from docstrings that ship with Python, in a fixed order."""
    import argparse as a
    import collections
    import csv
    import email
    import json as j
    import logging
    import os
    import pathlib
    import string
    import subprocess
    import tarfile
    import textwrap
    import threading
    import unittest
    import zipfile

    pieces = []
    for module in (collections, email, j, logging, os, pathlib, string, textwrap, unittest, a, inspect, csv, zipfile,
                   subprocess, threading, tarfile):
        pieces.append(inspect.getdoc(module) or "")
        for name in sorted(dir(module)):  # then the public classes' and functions' docs, alphabetically
            obj = getattr(module, name)
            if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                doc = inspect.getdoc(obj) or ""
                if len(doc) > 200:
                    pieces.append(doc)
    ids = tokenizer.encode("\n\n".join(p for p in pieces if p))
    assert len(ids) >= count * tokens_each, "not enough text"
    return [tokenizer.decode(ids[i * tokens_each : (i + 1) * tokens_each]) for i in range(count)]


QUESTIONS = [
    "Summarise the passage above in two sentences.",
    "Which module did the first passage describe, and what is it for?",
    "Compare this passage with the first one: what do they have in common?",
    "List three technical terms that appeared in the earlier passages.",
    "What was the main topic of the second passage?",
    "Which passage so far was the longest, and why do you think so?",
]


def run(llm, recipe, system, messages, answers=None):
    """Feed the turns; with answers, teacher-force them and keep log-probs. Returns per-turn records."""
    conv = llm.conversation(system=system, recipe=recipe)
    out = []
    for i, message in enumerate(messages):
        kw = dict(logprobs=True) | (dict(force=answers[i]) if answers else dict(max_new_tokens=32))
        start = time.perf_counter()
        reply = conv.send(message, **kw)
        out.append({"tokens": reply.token_ids, "logprobs": reply.logprobs, "kv_bytes": conv.kv_bytes,
                    "kv_tokens_per_head": float(conv.kv.lengths.mean()), "seconds": time.perf_counter() - start,
                    "history_tokens": len(conv.tokens)})
    conv.close()
    return out


def fidelity(full_turn, turn):
    return (greedy_agreement(turn["logprobs"], full_turn["tokens"]),
            mean_kl(full_turn["logprobs"], turn["logprobs"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="0.1,0.25,0.5", help="keep ratios")
    ap.add_argument("--methods", default="snapkv,ada-snapkv,h2o,streaming-llm,pyramidkv")
    ap.add_argument("--policies", default="recompress,flowkv")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=900)
    ap.add_argument("--out", default="benchmarks/quality/results/eviction_multiturn")
    args = ap.parse_args()

    llm = turnkv.LLM(dtype="float32", device="cpu", kv_memory="2GiB")
    passages = documents(llm.tokenizer, args.turns, args.passage_tokens)
    messages = [f"{p}\n\n{QUESTIONS[i % len(QUESTIONS)]}" for i, p in enumerate(passages)]
    system = "You are a helpful assistant. Answer briefly and precisely."

    full = run(llm, "full", system, messages)
    answers = [t["tokens"] for t in full]
    full_forced = run(llm, "full", system, messages, answers)  # same path as the methods, as the reference
    sanity = [fidelity(a, b) for a, b in zip(full_forced, full_forced)]
    assert all(ag == 1.0 and abs(kl) < 1e-6 for ag, kl in sanity)

    rows = []
    grid = [(m, p, b) for b in map(float, args.budgets.split(",")) for m in args.methods.split(",")
            for p in args.policies.split(",")]
    for method, policy, keep in tqdm(grid, desc="recipes"):
        recipe = preset(method).with_overrides({"keep_ratio": str(keep), "turns": policy})
        turns = run(llm, recipe, system, messages, answers)
        per_turn = [fidelity(f, t) for f, t in zip(full_forced, turns)]
        rows.append({
            "method": method, "policy": policy, "keep_ratio": keep, "recipe": str(recipe),
            "kv_bytes_vs_full": [t["kv_bytes"] / f["kv_bytes"] for t, f in zip(turns, full_forced)],
            "agreement": [a for a, _ in per_turn], "kl": [k for _, k in per_turn],
            "seconds": sum(t["seconds"] for t in turns),
        })
    result = {
        "command": "python benchmarks/quality/eviction_multiturn.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": "SmolLM2-135M-Instruct (embedded GGUF), float32, CPU",
        "history_tokens_per_turn": [t["history_tokens"] for t in full],
        "full_kv_bytes_per_turn": [t["kv_bytes"] for t in full_forced],
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    T = args.turns
    lines = [
        "# Eviction under multi-turn policies (SmolLM2-135M, CPU)", "",
        f"Command: `{result['command']}`", "",
        f"History after each turn: {result['history_tokens_per_turn']} tokens. KV bytes are measured after the last "
        "turn against the full cache's. Agreement: teacher-forced top-1 agreement with the full run's greedy answer; "
        "KL: mean KL(full || method) of the next-token distribution along that answer.", "",
        "| method | policy | keep | KV vs full | " + " | ".join(f"agree t{i+1}" for i in range(T)) + " | "
        + " | ".join(f"KL t{i+1}" for i in range(T)) + " |",
        "|---|---|---|---|" + "---|" * (2 * T),
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['policy']} | {r['keep_ratio']:.2f} | {r['kv_bytes_vs_full'][-1]:.2f} | "
                     + " | ".join(f"{a:.2f}" for a in r["agreement"]) + " | "
                     + " | ".join(f"{k:.3f}" for k in r["kl"]) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
