"""TTFT of a returning conversation restored from the CPU tier (pinned host pool), per restoration
strategy: recompute, load, partial, krul, minicache (and krul_fix). Llama-3.1-8B shape, bf16, random
weights, histories of 8K/16K/32K tokens. Also the disk tier after a process restart.

For each history length the script prefills the history, runs one more "turn" (a prompt and a few
decode steps, with Krul's query recorder on, as a real turn end would have), packs the state with
each strategy into the CPU tier, and times the returning turn: restore + prefill of the new prompt +
the first token, synchronised, best of --repeats. For the split strategies it also times the
recompute stream alone and the load stream alone (overlap = T_both / max(T_C, T_L), target
<= 1.15), and the host time to issue the restore (restore_issue_s: what the host spends before
the streams run on their own).

Per row: pack_s (turn-end work on the GPU: estimator, pairing, schedule, export, merge, split in
pack_timing) and copy_s (into the pinned CPU tier) apart; stored bytes and their share of the full
KV; the bandwidth floor of the load stream (stored bytes / measured H2D). "krul_s50" is Krul with
storage=0.5 (at most half of the full KV stored).

Printed last: one table and the targets. JSON goes to --out (or $OUT), rewritten after every
row. A failing row is recorded with its error and the others go on; but a CUDA error (a device-side
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
import subprocess
import sys
import tempfile
import time
import traceback

import torch

import turnkv
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe
from turnkv.methods.registry import build
from turnkv.methods.step_context import StepContext
from turnkv.state import schedule
from turnkv.state.estimator import TurnQueries
from turnkv.state.split import restore_split

# Random weights have no Initial-Recent attention (it is near uniform: ~0.2 of the mass on the first
# and last 10%), so Krul's I-R test would exclude every layer; ir_threshold=0 lets it pair layers by
# attention distance alone. With real weights use plain "krul". label=spec; a plain spec is labelled
# by its strategy name. krul and krul_default fall back to load or recompute where the plan predicts
# no gain (the row's "fallback"); krul_split is the plan alone.
STRATEGIES = ["recompute", "load", "partial", "krul=krul(ir_threshold=0)", "krul_default=krul",
              "krul_split=krul(ir_threshold=0,fallback=never)", "krul_s50=krul(ir_threshold=0,storage=0.5)",
              "minicache", "krul_fix"]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_state(llm, n: int, turn_prompt: int, turn_decode: int):
    """A resident history of n tokens whose last turn (prompt + decode) was recorded for Krul."""
    ids = torch.randint(0, 32000, (n,)).tolist()
    seq = SequenceKV(llm.pool)
    window = TurnQueries(llm.config.num_layers, 0)
    llm.runner.prefill(seq, ids[: n - turn_prompt - turn_decode])
    llm.runner.prefill(seq, ids[n - turn_prompt - turn_decode : n - turn_decode], context=StepContext(window=window))
    for t in ids[n - turn_decode :]:
        llm.runner.decode([seq], torch.tensor([t], device=llm.device), [StepContext(window=window)])
    sync()
    return ids, seq, window


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


def ttft(llm, fn, new_prompt, repeats):
    """Best wall time of: fn(seq) (the restore; it may return the restore's load stream) + prefill of
    the new prompt + the first token."""
    best, detail = float("inf"), None
    for _ in range(repeats):
        seq = SequenceKV(llm.pool)
        try:
            sync()
            t = time.perf_counter()
            stream = fn(seq)
            logits = llm.runner.prefill(seq, new_prompt)
            int(logits.argmax())
            elapsed = time.perf_counter() - t
            sync()
            if stream is not None:
                stream.synchronize()  # as the engine does after a turn: the host sources are free again
            best = min(best, elapsed)
        finally:
            seq.free()  # also after a failure: a row must not leave pages behind for the next ones
    return best, detail


def stream_times(llm, ids, meta, tensors, repeats):
    """(T_compute alone, T_load alone, T_both) of a split restore, each best of `repeats`."""
    out = []
    for parts in (dict(load=False), dict(recompute=False), dict()):
        best = float("inf")
        for _ in range(repeats):
            seq = SequenceKV(llm.pool)
            try:
                sync()
                t = time.perf_counter()
                stream = restore_split(llm.state.ctx, seq, ids, meta, tensors, gate=False, **parts)
                stream.wait_all()
                sync()
                best = min(best, time.perf_counter() - t)
                stream.synchronize()
            finally:
                seq.free()
        out.append(best)
    return out


def run_length(llm, n, args):
    ctx = llm.state.ctx
    ids, seq, window = make_state(llm, n, args.turn_prompt, args.turn_decode)
    new_prompt = torch.randint(0, 32000, (args.new_prompt,)).tolist()
    full = n * llm.config.kv_bytes_per_token(llm.pool.k.element_size())
    rc = ctx.recompute_ratio(n, "cpu")
    bandwidth = ctx.cost("cpu").bytes_per_s
    rows = []
    try:
        for entry in args.strategies.split(";"):
            rows.append(run_row(llm, n, args, entry, ids, seq, window, new_prompt, full, rc, bandwidth))
            if "fatal" in rows[-1]:
                raise DeviceLost(rows[-1]["fatal"])
    except DeviceLost as e:
        e.rows = rows
        raise
    finally:
        seq.free()
    return rows


def run_row(llm, n, args, entry, ids, seq, window, new_prompt, full, rc, bandwidth):
    """One strategy at one history length; a failure is recorded in the row (and "fatal" when it left
    the device unusable)."""
    ctx, tiers = llm.state.ctx, llm.state.tiers
    label, spec = entry.split("=", 1) if "=" in entry.split("(")[0] else ("", entry)
    name = label or spec.split("(")[0]
    row = {"history": n, "strategy": name, "spec": spec, "calibrated_rc": rc}
    key = f"bench-{n}-{name}"
    saved = [list(layer) for layer in window.turn]  # Krul's estimator consumes the recorded turn
    try:
        strategy = Recipe.parse(f"state={spec}").state
        sync()
        t = time.perf_counter()
        stored = strategy.pack(ctx, seq, window, "cpu")
        sync()
        row["pack_s"] = time.perf_counter() - t
        t = time.perf_counter()
        tiers.put(key, {"state": stored.meta}, stored.tensors, "cpu")
        sync()
        row["copy_s"] = time.perf_counter() - t  # device -> pinned CPU tier
        _, meta, host = tiers.get(key)
        if llm.device.type == "cuda":
            assert all(t.is_pinned() for t in host.values()), "the CPU tier must be pinned for async copies"
        row["stored_bytes"] = stored.nbytes
        row["stored_share"] = stored.nbytes / full
        row["load_floor_s"] = stored.nbytes / bandwidth  # the load stream at the measured H2D bandwidth
        for key_ in ("starts", "pairs", "recompute_ratio", "recompute_share", "ir_score", "pack_timing",
                     "estimator_rows", "fallback", "predicted_s"):
            if key_ in stored.meta:
                row[key_] = stored.meta[key_]

        issue = []

        def restore(s, strategy=strategy, meta=meta, host=host):
            t0 = time.perf_counter()
            stream = strategy.restore(ctx, s, ids, meta["state"], host)
            issue.append(time.perf_counter() - t0)
            return stream  # kept until the measurement is synchronised

        row["ttft_s"], _ = ttft(llm, restore, new_prompt, args.repeats)
        row["restore_issue_s"] = min(issue)
        if "starts" in stored.meta:
            row["t_compute_s"], row["t_load_s"], row["t_both_s"] = stream_times(llm, ids, meta["state"], host,
                                                                                args.repeats)
            row["overlap"] = row["t_both_s"] / max(row["t_compute_s"], row["t_load_s"])
        sync()  # an asynchronous device error surfaces in the row that caused it
    except Exception as e:  # one strategy failing must not lose the others' figures
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        lost = device_error(llm)
        if lost is not None:
            row["fatal"] = (f"the CUDA context is unusable after {name} at {n} tokens ({lost[:300]}); "
                            f"CUDA reports errors asynchronously, so the failing kernel may have been issued "
                            f"a little earlier: rerun with CUDA_LAUNCH_BLOCKING=1 to pin it down")
    finally:
        window.turn = saved
        tiers.delete(key)  # also after a failure: its CPU-tier memory would be lost to later rows
    print(json.dumps({k: v for k, v in row.items() if k not in ("ir_score", "starts")}), flush=True)
    return row


RESTART = """
import json, sys, time, torch, turnkv
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.tiers import TieredStore
from turnkv.methods.registry import build
from turnkv.methods.step_context import StepContext
from turnkv.methods.step_context import StepContext
t0 = time.perf_counter()
llm = turnkv.LLM(sys.argv[3], dtype="bfloat16", device=sys.argv[4], kv_memory=sys.argv[2], state_cpu_memory=0)
startup = time.perf_counter() - t0
store = TieredStore(0, sys.argv[1])
ids = json.load(open(sys.argv[1] + "/../ids.json"))
prompt = ids[-128:]
rows = []
for key in store.keys("disk"):
    for attempt in range(2):  # the first read is cold; the second finds the file in the page cache
        seq = SequenceKV(llm.pool)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t = time.perf_counter()
        _, meta, tensors = store.get(key)
        read_s = time.perf_counter() - t  # the file read, its checksums and the deserialisation
        strategy = build("state", meta["strategy"], {})  # restore reads its plan from meta, not params
        stream = strategy.restore(llm.state.ctx, seq, ids, meta["state"], tensors)
        int(llm.runner.prefill(seq, prompt).argmax())
        if stream is not None:
            stream.synchronize()
        rows.append({"strategy": meta["strategy"], "attempt": attempt, "ttft_s": time.perf_counter() - t,
                     "read_s": read_s, "history": meta["state"]["next_position"], "startup_s": startup,
                     "stored_bytes": int(store.meta(key)["nbytes"]), "disk_read_rate": store.disk.read_rate})
        seq.free()
# What the state manager weighs a disk read against: recomputing the history in this process.
n = rows[0]["history"] if rows else len(ids) - 128
for attempt in range(2):
    seq = SequenceKV(llm.pool)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    llm.runner.prefill(seq, ids[:n])
    int(llm.runner.prefill(seq, prompt).argmax())
    rows.append({"strategy": "recompute", "attempt": attempt, "ttft_s": time.perf_counter() - t, "history": n,
                 "startup_s": startup})
    seq.free()
print(json.dumps(rows))
"""


def disk_restart(llm, n, args, out_dir):
    """Store the state on disk, then restore it in a new process (a restart)."""
    store_dir = os.path.join(out_dir, "disk_store")
    os.makedirs(store_dir, exist_ok=True)
    from turnkv.kv.tiers import TieredStore

    store = TieredStore(0, store_dir)
    ids, seq, window = make_state(llm, n, args.turn_prompt, args.turn_decode)
    with open(os.path.join(out_dir, "ids.json"), "w") as f:  # beside the store, not in it
        json.dump(ids, f)
    for name in ("load", "krul"):
        strategy = build("state", name, {"ir_threshold": 0.0} if name == "krul" else {})
        stored = strategy.pack(llm.state.ctx, seq, window, "disk")
        store.put(f"restart-{name}", {"strategy": name, "state": stored.meta}, stored.tensors, "disk")
    seq.free()
    # The new process shares the GPU with this one, which still holds its weights and KV pool: give
    # it a pool sized for this history only, and return this process's cached blocks first.
    if llm.device.type == "cuda":
        torch.cuda.empty_cache()
    child_kv = (n + 4096) * llm.config.kv_bytes_per_token(llm.dtype.itemsize)
    result = subprocess.run([sys.executable, "-c", RESTART, store_dir, str(child_kv), args.shape, str(llm.device)],
                            capture_output=True, text=True)
    if result.returncode:
        return [{"error": result.stderr[-2000:]}]
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--histories", default="8192,16384,32768")
    p.add_argument("--strategies", default=";".join(STRATEGIES), help="state terms separated by ;")
    p.add_argument("--new-prompt", type=int, default=128)
    p.add_argument("--turn-prompt", type=int, default=256)
    p.add_argument("--turn-decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-memory", default="24GiB")
    p.add_argument("--cpu-memory", default="20GiB")
    p.add_argument("--skip-disk", action="store_true")
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
    torch.manual_seed(0)
    llm = turnkv.LLM(args.shape, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory,
                     state_cpu_memory=args.cpu_memory)
    ctx = llm.state.ctx
    cost = ctx.cost("cpu")  # calibrated here: recompute a, b and the pinned H2D bandwidth
    result = {"command": "python benchmarks/state/gpu_state_restore.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu", "shape": args.shape,
              "dtype": args.dtype,
              "h2d_pinned_gb_s": cost.bytes_per_s / 1e9,
              "h2d_pageable_gb_s": schedule.measure_bandwidth(llm.device, pinned=False) / 1e9,
              "recompute_a_s_per_token_layer": cost.per_token_layer_s,
              "recompute_b_s_per_token2_layer": cost.per_token2_layer_s, "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for n in map(int, args.histories.split(",")):
        try:
            result["rows"] += run_length(llm, n, args)
        except DeviceLost as e:
            result["rows"] += e.rows
            result["fatal"] = str(e)
        except Exception as e:  # the history itself could not be built (make_state)
            traceback.print_exc()
            result["rows"].append({"history": n, "strategy": "(history)", "error": f"{type(e).__name__}: {e}"})
            lost = device_error(llm)
            if lost is not None:
                result["fatal"] = f"the CUDA context is unusable after building the {n}-token history ({lost[:300]})"
        with open(os.path.join(args.out, "gpu_state_restore.json"), "w") as f:
            json.dump(result, f, indent=1)
        if "fatal" in result:
            break
    if "fatal" in result:
        print(f"\nSTOPPED: {result['fatal']}\nThe rows so far are in {args.out}/gpu_state_restore.json; "
              f"the later ones were not run (a new process is needed).", file=sys.stderr, flush=True)
        table(result)
        sys.exit(1)
    if not args.skip_disk:
        n = max(map(int, args.histories.split(",")))
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            result["disk_restart"] = disk_restart(llm, n, args, tmp)
        print(json.dumps(result["disk_restart"]), flush=True)
    with open(os.path.join(args.out, "gpu_state_restore.json"), "w") as f:
        json.dump(result, f, indent=1)

    table(result)
    targets(result)
    with open(os.path.join(args.out, "gpu_state_restore.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in result.get("disk_restart", []):
        print("disk restart:", json.dumps(r))


def table(result):
    print(f"\nH2D pinned {result['h2d_pinned_gb_s']:.1f} GB/s, pageable {result['h2d_pageable_gb_s']:.1f} GB/s; "
          f"{result['device']}")
    header = f"{'history':>8} {'strategy':>10} {'TTFT ms':>9} {'x recomp':>8} {'x load':>7} {'stored/full':>11} " \
             f"{'r_c':>5} {'rec.sh':>6} {'T_C ms':>7} {'T_L ms':>7} {'floor ms':>8} {'overlap':>7} {'issue ms':>8} " \
             f"{'pack s':>7} {'copy s':>6}  pack split"
    print(header)
    for n in sorted({r["history"] for r in result["rows"]}):
        rows = {r["strategy"]: r for r in result["rows"] if r["history"] == n}
        base_re = rows.get("recompute", {}).get("ttft_s")
        base_ld = rows.get("load", {}).get("ttft_s")
        for name, r in rows.items():
            if "error" in r:
                print(f"{n:>8} {name:>10} error: {r['error'][:80]}")
                continue
            t = r["ttft_s"]
            print(f"{n:>8} {name:>10} {1000 * t:9.1f} {base_re / t if base_re else float('nan'):8.2f} "
                  f"{base_ld / t if base_ld else float('nan'):7.2f} {r['stored_share']:11.3f} "
                  f"{r.get('recompute_ratio', 0) or 0:5.2f} {r.get('recompute_share', 0) or 0:6.3f} "
                  f"{1000 * r.get('t_compute_s', 0):7.1f} {1000 * r.get('t_load_s', 0):7.1f} "
                  f"{1000 * r.get('load_floor_s', 0):8.1f} {r.get('overlap', float('nan')):7.2f} "
                  f"{1000 * r.get('restore_issue_s', 0):8.1f} {r['pack_s']:7.3f} {r['copy_s']:6.3f}  "
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
        out["krul_pack_s"] = k["pack_s"]
        if "overlap" in k:
            out["krul_overlap"] = k["overlap"]  # target <= 1.15
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
