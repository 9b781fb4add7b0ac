"""Fidelity of quantized KV (int8, fp8 e4m3; per token and head, fp32 scales) to full-precision KV on
SmolLM2-135M-Instruct (CPU, fp32), turn by turn, with the KV bytes each holds.

The multi-turn conversations of the eviction and state benchmarks: two ~4K-token conversations of four
turns, each turn a ~900-token passage and a question (benchmarks/quality/eviction_multiturn.py, two passage
sets), and the three short four-turn chats of benchmarks/state/state_fidelity.py. The full-precision engine
answers greedily; every other engine is teacher-forced along those answers, with log-probabilities
kept, so each compares next-token distributions on the same history: greedy agreement (its argmax
is the full engine's token) and mean KL(full || quantized). Rows:
  - int8 / fp8 KV against fp32 KV;
  - bf16 compute with bf16 KV (the model run in bfloat16), as a yardstick for the size of these
    deviations;
  - SnapKV keeping 25% of each turn's history (recompress policy) in fp32 and in int8 KV, against the
    full fp32 cache: quantization on top of eviction.

Usage: python benchmarks/quality/kv_quant_fidelity.py [--out benchmarks/quality/results] [--max-new-tokens 48]
Writes kv_quant_fidelity.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "state"))  # state_fidelity
from eviction_multiturn import QUESTIONS, documents  # noqa: E402
from state_fidelity import CONVERSATIONS  # noqa: E402

import turnkv  # noqa: E402
from turnkv.bench.metrics import greedy_agreement, mean_kl  # noqa: E402

LONG_SYSTEM = "You are a helpful assistant. Answer briefly and precisely."


def conversations(tokenizer, turns: int, passage_tokens: int) -> list[tuple[str, list[str]]]:
    passages = documents(tokenizer, 2 * turns, passage_tokens)
    out = []
    for c in range(2):
        texts = passages[c * turns : (c + 1) * turns]
        out.append((LONG_SYSTEM, [f"{p}\n\n{QUESTIONS[i % len(QUESTIONS)]}" for i, p in enumerate(texts)]))
    return out + [(system, messages) for system, messages in CONVERSATIONS]


def run(llm, system, messages, recipe=None, answers=None, max_new_tokens=64):
    conv = llm.conversation(system=system, recipe=recipe)
    out = []
    try:
        for i, message in enumerate(messages):
            kw = dict(force=answers[i]) if answers else dict(max_new_tokens=max_new_tokens)
            reply = conv.send(message, logprobs=True, **kw)
            out.append({"tokens": reply.token_ids, "logprobs": reply.logprobs.float(), "kv_bytes": conv.kv_bytes,
                        "history": len(conv.tokens)})
    finally:
        conv.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/quality/results"))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=900)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on a shared machine, more threads spin against other work)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    engines = {"fp32": turnkv.LLM(dtype="float32", device="cpu", kv_memory="384MiB")}
    engines["int8"] = turnkv.LLM(dtype="float32", device="cpu", kv_memory="384MiB", kv_dtype="int8")
    engines["fp8"] = turnkv.LLM(dtype="float32", device="cpu", kv_memory="384MiB", kv_dtype="fp8")
    engines["bf16"] = turnkv.LLM(dtype="bfloat16", device="cpu", kv_memory="384MiB")
    convs = conversations(engines["fp32"].tokenizer, args.turns, args.passage_tokens)
    rows_spec = [  # label, engine, recipe
        ("int8 KV", "int8", None), ("fp8 KV", "fp8", None), ("bf16 model + bf16 KV", "bf16", None),
        ("snapkv 25%, fp32 KV", "fp32", "snapkv keep_ratio=0.25"),
        ("snapkv 25%, int8 KV", "int8", "snapkv keep_ratio=0.25 kv_dtype=int8"),
    ]
    references, details = [], {}
    for system, messages in convs:  # (a forced run along these replies computes the same log-probabilities)
        references.append(run(engines["fp32"], system, messages, max_new_tokens=args.max_new_tokens))
    rows = []
    for name, engine, recipe in rows_spec:
        start = time.perf_counter()
        per_conv = []
        for (system, messages), ref in zip(convs, references):
            got = run(engines[engine], system, messages, recipe, answers=[t["tokens"] for t in ref])
            per_conv.append([{"agreement": greedy_agreement(g["logprobs"], r["tokens"]),
                              "kl": mean_kl(r["logprobs"], g["logprobs"]), "tokens": len(r["tokens"]),
                              "kv_bytes": g["kv_bytes"], "full_kv_bytes": r["kv_bytes"], "history": r["history"]}
                             for g, r in zip(got, ref)])
        turns = len(per_conv[0])
        by_turn = []
        for t in range(turns):
            cells = [c[t] for c in per_conv]
            n = sum(c["tokens"] for c in cells)
            by_turn.append({"turn": t + 1, "agreement": sum(c["agreement"] * c["tokens"] for c in cells) / n,
                            "kl": sum(c["kl"] * c["tokens"] for c in cells) / n,
                            "kv_bytes_vs_full": sum(c["kv_bytes"] for c in cells) / sum(c["full_kv_bytes"] for c in cells)})
        n = sum(c["tokens"] for conv in per_conv for c in conv)
        row = {"setting": name, "engine": engine, "recipe": recipe,
               "agreement": sum(c["agreement"] * c["tokens"] for conv in per_conv for c in conv) / n,
               "min_agreement": min(c["agreement"] for conv in per_conv for c in conv),
               "kl": sum(c["kl"] * c["tokens"] for conv in per_conv for c in conv) / n,
               "kv_bytes_vs_full": by_turn[-1]["kv_bytes_vs_full"], "by_turn": by_turn,
               "scored_tokens": n, "seconds": time.perf_counter() - start}
        rows.append(row)
        details[name] = per_conv
        print(json.dumps({k: v for k, v in row.items() if k != "by_turn"}), flush=True)
    full = engines["fp32"]
    result = {
        "command": "python benchmarks/quality/kv_quant_fidelity.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": "SmolLM2-135M-Instruct (embedded GGUF), CPU", "torch_threads": torch.get_num_threads(),
        "kv_bytes_per_token": {name: llm.kv_bytes_per_token() for name, llm in engines.items()},
        "conversations": [{"history_tokens_per_turn": [t["history"] for t in ref]} for ref in references],
        "rows": rows, "per_conversation": details, "wall_s": time.perf_counter() - t0,
        "model_config": {"layers": full.config.num_layers, "kv_heads": full.config.num_kv_heads,
                         "head_dim": full.config.head_dim},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_quant_fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    T = args.turns
    lines = [f"`{result['command']}` on SmolLM2-135M-Instruct (CPU). {len(convs)} conversations of {T} turns "
             f"(two of ~{references[0][-1]['history']} tokens, three short chats), teacher-forced along the fp32 "
             f"engine's greedy replies; {rows[0]['scored_tokens']} scored tokens per row. KV bytes per token "
             f"(all layers): " + ", ".join(f"{k} {v}" for k, v in result["kv_bytes_per_token"].items()) + ".", "",
             "| setting | greedy agreement | min (turn) | mean KL | KV bytes vs fp32 full | "
             + " | ".join(f"agree t{i + 1}" for i in range(T)) + " | " + " | ".join(f"KL t{i + 1}" for i in range(T)) + " |",
             "|---|---|---|---|---|" + "---|" * (2 * T)]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['agreement']:.3f} | {r['min_agreement']:.3f} | {r['kl']:.5f} | "
                     f"{r['kv_bytes_vs_full']:.3f} | " + " | ".join(f"{t['agreement']:.3f}" for t in r["by_turn"])
                     + " | " + " | ".join(f"{t['kl']:.5f}" for t in r["by_turn"]) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "kv_quant_fidelity.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
