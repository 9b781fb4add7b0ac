"""The disk tier after a restart, through the public path, for benchmarks/state/gpu_state_restore.py:
per strategy a conversation's history is stored on disk (conv.offload("disk")), and a new process
with the same state_disk_dir and no CPU tier continues it (llm.resume(id), conv.send) twice: the
first turn after the restart, then a turn from the entry that process stored again on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import turnkv

RESTART = """
import json, sys, time, torch, turnkv
from turnkv.model.config import SHAPES, shape_config
job = json.load(open(sys.argv[1]))
if job["positions"]:  # the parent's raised context of a random-weight shape (extend_context)
    SHAPES[job["shape"].lower()] = shape_config(job["shape"], job["positions"])
if job["vocab_size"]:  # and its raised vocabulary (extend_vocabulary)
    from dataclasses import replace
    SHAPES[job["shape"].lower()] = replace(SHAPES[job["shape"].lower()], vocab_size=job["vocab_size"])
def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
t0 = time.perf_counter()
# No CPU tier: the state a returning turn stores again goes to disk, so the second turn reads it back.
llm = turnkv.LLM(job["shape"], dtype=job["dtype"], device=job["device"], kv_memory=job["kv_memory"],
                 state_cpu_memory=0, state_disk_dir=job["store"])
startup = time.perf_counter() - t0
# The disk tier's restore costs, calibrated once per engine at first need: the first turn that weighs
# a disk read against a recompute (once the disk's read rate is known). Done here, not inside a TTFT.
t0 = time.perf_counter()
llm.state.ctx.cost("disk")
calibration = time.perf_counter() - t0
rows = []
for name, conversation_id in job["conversations"].items():
    conv = llm.resume(conversation_id)
    for attempt in range(2):  # 0: the first turn after the restart; 1: from the entry this process wrote
        where, stored, seen = conv.location, llm.state.stored_bytes(conv), len(llm.state.events)
        sync()
        t = time.perf_counter()
        reply = conv.send(job["prompt"], max_new_tokens=1, ignore_eos=True)
        sync()
        rows.append({"strategy": name, "attempt": attempt, "from": where, "ttft_s": reply.ttft_s,
                     "send_s": time.perf_counter() - t, "stored_bytes": stored, "startup_s": startup,
                     "calibration_s": calibration,
                     "history_tokens": reply.cached_tokens,
                     "prompt_tokens": reply.prompt_tokens, "disk_read_rate": llm.state.tiers.disk.read_rate,
                     "events": [e["event"] for e in llm.state.events[seen:]]})
    conv.close()
print(json.dumps(rows))
"""


def disk_restart(llm, n, args, history, store_dir: str) -> list[dict]:
    """Store a history of n tokens on disk per strategy (conv.offload("disk")), then continue each
    conversation in a new process (llm.resume(id), conv.send), as after a restart. llm: an engine
    whose state_disk_dir is `store_dir`; history: gpu_state_restore.History (its conversations and
    returning prompt); args: the script's (shape, dtype, raised_context). Returns the new process's
    rows per strategy and attempt, or one row with the error."""
    specs = {"load": "load", "krul": "krul(ir_threshold=0)", "recompute": "recompute"}
    convs = {}
    try:
        for name, spec in specs.items():
            convs[name] = history.conversation(llm, spec)
            if convs[name].offload("disk") != "disk":
                return [{"error": f"{name}: the state did not land in the disk tier"}]
        # The new process shares the GPU with this one, which still holds its weights and KV pool: give
        # it a pool sized for this history only, and return this process's cached blocks first.
        if llm.device.type == "cuda":
            torch.cuda.empty_cache()
        job = {"shape": args.shape, "dtype": args.dtype, "device": str(llm.device), "store": store_dir,
               "positions": llm.config.max_position_embeddings if args.raised_context else None,
               "vocab_size": llm.config.vocab_size if args.raised_vocabulary else None,
               "kv_memory": (n + 4096) * llm.kv_bytes_per_token(), "prompt": history.new,
               "conversations": {name: conv.id for name, conv in convs.items()}}
        job_path = os.path.join(os.path.dirname(store_dir), "restart_job.json")  # beside the store, not in it
        with open(job_path, "w") as f:
            json.dump(job, f)
        # The new process imports the engine this one runs (not whichever `turnkv` its directory holds).
        root = os.path.dirname(os.path.dirname(os.path.abspath(turnkv.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        result = subprocess.run([sys.executable, "-c", RESTART, job_path], capture_output=True, text=True, env=env)
        if result.returncode:
            return [{"error": result.stderr[-2000:]}]
        return json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        for conv in convs.values():
            conv.close()  # the new process consumed the stored entries; whatever is left goes
