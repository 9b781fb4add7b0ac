"""Fidelity of the lossy restoration strategies (Krul, MiniCache, Krul (Fix)) to the resident state
on SmolLM2-135M-Instruct (CPU), with the bytes each stores; the exact ones are listed as controls.
Also the disk tier: TTFT of a returning conversation after a process restart.

Every method replays the same multi-turn conversations. Each turn is teacher-forced along the
resident run's reply, with log-probabilities kept, so the history is the same for all methods and
the metrics are per token: greedy agreement (argmax equals the resident token) and KL(resident ||
method). Between turns the state leaves the GPU tier and the next turn restores it.

Usage: python benchmarks/state/state_fidelity.py [--out benchmarks/state/results] [--max-new-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import turnkv
from turnkv.bench.metrics import greedy_agreement, mean_kl

CONVERSATIONS = [
    ("You are a helpful assistant.", [
        "My name is Ada and I keep bees in a small garden in Lyon. Remember the number 7261; I will ask for it later. "
        "Can you explain in three sentences how bees make honey?",
        "Interesting. What do bees do during the winter?",
        "What is my name, and where is my garden?",
        "What was the number I asked you to remember?"]),
    ("You are a concise assistant.", [
        "Here is a shopping list: apples, rice, lentils, olive oil, coffee, and two lemons. Suggest a dinner I could cook.",
        "Which items on the list would I not use for that dinner?",
        "Write a short haiku about lemons.",
        "How many items were on my list?"]),
    ("You are a friendly tutor.", [
        "Explain what a prime number is, with two examples.",
        "Is 91 a prime number? Explain.",
        "Now explain what a composite number is, referring back to your first answer.",
        "Summarise our conversation in two sentences."]),
]
METHODS = ["krul", "minicache", "krul_fix", "krul(allocation=min_storage)", "partial", "load", "recompute"]


def replay(llm, system, messages, recipe, reference=None, max_new_tokens=40):
    conv = llm.conversation(system=system, recipe=recipe)
    turns = []
    for i, message in enumerate(messages):
        force = reference[i]["tokens"] if reference else None
        reply = conv.send(message, max_new_tokens=max_new_tokens, force=force, logprobs=True)
        stored = llm.state.stored_bytes(conv) if conv.location in ("cpu", "disk") else None
        meta = llm.state.tiers.meta(conv.id)["state"] if stored is not None else {}
        n = meta.get("next_position", conv.kv.next_position)
        turns.append({"tokens": reply.token_ids, "logprobs": reply.logprobs, "stored_bytes": stored,
                      "full_kv_bytes": n * llm.config.kv_bytes_per_token(llm.dtype.itemsize), "history": n,
                      "pairs": meta.get("pairs"), "starts": meta.get("starts"), "ir_score": meta.get("ir_score"),
                      "ttft_s": reply.ttft_s})
    conv.close()
    return turns


def fidelity(llm, max_new_tokens):
    rows, details = [], {}
    references = [replay(llm, s, m, "state=gpu", max_new_tokens=max_new_tokens) for s, m in CONVERSATIONS]
    for method in METHODS:
        agree, kls, stored, full, per_turn = [], [], 0, 0, []
        t = time.perf_counter()
        for (system, messages), ref in zip(CONVERSATIONS, references):
            got = replay(llm, system, messages, f"state={method}", ref, max_new_tokens)
            for turn, (g, r) in enumerate(zip(got, ref)):
                # Turn 1 restores nothing: every method is exact there. Score the returning turns.
                if turn == 0:
                    continue
                agree.append(greedy_agreement(g["logprobs"], r["tokens"]))
                kls.append(mean_kl(r["logprobs"], g["logprobs"]))
            for g in got:
                stored += g["stored_bytes"] or 0
                full += g["full_kv_bytes"]
            per_turn.append([{k: g[k] for k in ("stored_bytes", "full_kv_bytes", "history", "pairs", "starts", "ir_score")}
                             for g in got])
        rows.append({"method": method, "greedy_agreement": sum(agree) / len(agree), "mean_kl": sum(kls) / len(kls),
                     "min_agreement": min(agree), "stored_bytes": stored, "stored_share": stored / full,
                     "wall_s": time.perf_counter() - t})
        details[method] = per_turn
        print(json.dumps(rows[-1]), flush=True)
    return rows, details


RESTART = """
import json, sys, time, turnkv
llm = turnkv.LLM(state_disk_dir=sys.argv[1])
conv = llm.resume(sys.argv[2])
where = conv.location
reply = conv.send(sys.argv[3], max_new_tokens=8)
print(json.dumps({"where": where, "ttft_s": reply.ttft_s, "cached_tokens": reply.cached_tokens,
                  "prompt_tokens": reply.prompt_tokens, "events": llm.state.events}))
"""


def disk_restart(max_new_tokens):
    """A conversation stored on disk by one process, continued by a fresh one."""
    system, messages = CONVERSATIONS[0]
    out = []
    for state in ("load", "krul", "recompute"):
        with tempfile.TemporaryDirectory() as store:
            llm = turnkv.LLM(state_disk_dir=store)
            conv = llm.conversation(system=system, recipe=f"state={state}")
            for m in messages[:3]:
                conv.send(m, max_new_tokens=max_new_tokens)
            conv.offload("disk")
            stored = llm.state.stored_bytes(conv)
            result = subprocess.run([sys.executable, "-c", RESTART, store, conv.id, messages[3]], capture_output=True,
                                    text=True, check=True, env={**os.environ})
            row = {"state": state, "stored_bytes_on_disk": stored, **json.loads(result.stdout.strip().splitlines()[-1])}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/state/results"))
    p.add_argument("--max-new-tokens", type=int, default=40)
    args = p.parse_args()
    torch.manual_seed(0)
    llm = turnkv.LLM()
    rows, details = fidelity(llm, args.max_new_tokens)
    restart = disk_restart(args.max_new_tokens)
    os.makedirs(args.out, exist_ok=True)
    result = {"command": "python benchmarks/state/state_fidelity.py", "model": llm.name, "device": "cpu",
              "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "conversations": len(CONVERSATIONS), "turns": len(CONVERSATIONS[0][1]),
              "fidelity": rows, "disk_restart": restart, "per_turn": details}
    with open(os.path.join(args.out, "state_fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| method | greedy agreement | min (turn) | mean KL | stored / full KV |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['greedy_agreement']:.3f} | {r['min_agreement']:.3f} | {r['mean_kl']:.4f} | "
              f"{r['stored_share']:.3f} |" for r in rows]
    lines += ["", "| disk tier, after a restart | stored bytes | TTFT (s) | tokens restored | prompt tokens |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['state']} | {r['stored_bytes_on_disk']} | {r['ttft_s']:.3f} | {r['cached_tokens']} | "
              f"{r['prompt_tokens']} |" for r in restart]
    table = "\n".join(lines)
    with open(os.path.join(args.out, "state_fidelity.md"), "w") as f:
        f.write(f"`python benchmarks/state/state_fidelity.py` on SmolLM2-135M-Instruct, CPU fp32; returning turns "
                f"(2-4) of {len(CONVERSATIONS)} conversations, teacher-forced along the resident replies.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
