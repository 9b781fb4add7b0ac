"""The server's batched steps per recipe: --batch conversations of --context tokens are admitted through
the server's seam (turnkv/serve/engine_ops.py: begin_turn, prefill in slices, take, settle), then
(a) decode-only steps and (b) mixed steps (one --slice prefill slice of a new conversation beside one
decode token of each of the others) run as the server's worker runs them (serve/forwards.py: _decode
and _mixed, sampling included). Per recipe it prints the wall ms per step, the torch ops (top-level
aten calls) and device kernel launches per step, the ops' counts by name, and the top host functions
(cProfile, calls per step); --out writes the figures as JSON.

    # H100: Llama-3.1-8B shape, random weights
    python benchmarks/serving/step_profile.py --model llama-3.1-8b --dtype bfloat16 --device cuda \\
        --recipes full,lserve --batch 32 --context 16384 --slice 2048 --kv-memory 56GiB --out step_profile.json
    # CPU: a tiny random model, LServe scaled to its context (selection and trimming both run)
    python benchmarks/serving/step_profile.py --model tiny --dtype float32 --device cpu --batch 16 --context 512 \\
        --slice 128 --recipes "full,lserve-random decode=lserve(budget=128) \\
        prefill=streaming_heads(pattern=random,sink=16,local=64,prefill_local=128)"

`lserve` names the capacity benchmark's LServe (`lserve-random`: random weights have no calibrated head
pattern). --graphs-on-cpu runs the graphed decode's host side on CPU (the steps the graphs would replay
run eagerly, as the engine's CPU tests run them); --ride-mixed puts every decoding turn in the mixed
forward, where the server sends turns whose decode selects under CUDA graphs to a graphed decode step
first. A recipe that cannot hold every conversation runs with those that fit (`admitted`), less one
whose room the mixed steps' prompt takes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import cProfile
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import turnkv
from turnkv.engine import decode_loop, mixed
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.engine.turn import TurnInput
from turnkv.errors import KVCacheFullError
from turnkv.methods.recipe import Recipe
from turnkv.methods.terms import split_recipe_list, split_top_level
from turnkv.model import config as model_config
from turnkv.serve.engine_ops import EngineOps

ALIASES = {"lserve": "lserve-random"}
# A random model small enough for CPU profiles: 4 layers of 4 KV heads (2 queries each), head_dim 16.
TINY = model_config.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=8,
                                num_kv_heads=4, head_dim=16, max_position_embeddings=65536)


def recipe_of(name: str) -> str:
    tokens = split_top_level(name)
    return " ".join([ALIASES.get(tokens[0], tokens[0])] + tokens[1:])


class Server:
    """The worker's side of the steps for one recipe: EngineOps over its turns."""

    def __init__(self, llm, ops: EngineOps, recipe_key: str, context: int, seed: int, ride_mixed: bool = False):
        self.llm, self.ops, self.key, self.ride_mixed = llm, ops, recipe_key, ride_mixed
        self.recipe = llm.resolve_recipe(Recipe.parse(recipe_key))
        self.context = context
        self.gen = torch.Generator().manual_seed(seed)
        self.convs, self.turns, self.long = [], [], None
        self.parts = collections.Counter()

    def _prompt(self) -> list[int]:
        return torch.randint(10, self.llm.config.vocab_size - 10, (self.context,), generator=self.gen).tolist()

    def _begin(self, max_new: int):
        conv = self.ops.new_conversation(self.recipe, self.key)
        self.convs.append(conv)
        ids = self._prompt()
        params = self.llm.turn_parts.sampling_params(max_new_tokens=max_new, ignore_eos=True)
        gen = self.llm.turn_parts.new_generation(conv.kv, params)
        return conv, self.ops.begin_turn(conv, TurnInput(0, ids, len(ids), None, None, "", prefix_end=0), gen)

    def admit(self, batch: int, max_new: int) -> int:
        """Prefill `batch` conversations in the server's slices, take each first token, settle; then
        let the last ones go until the pool holds the mixed steps' prompt and max_new more tokens of
        every conversation."""
        chunk = self.llm.runner.prefill_chunk
        for _ in range(batch):
            conv, turn = self._begin(max_new)
            try:
                logits = None
                while logits is None:
                    logits = self.ops.prefill(turn, chunk)
            except KVCacheFullError:
                self.ops.abandon(turn)
                self._close(conv)
                break
            self.ops.take(turn, logits)
            self.ops.settle(turn)
            self.turns.append(turn)
        pool = self.llm.pool
        per_head = lambda tokens: -(-tokens // pool.page_size) + 1  # noqa: E731 - pages, a partial one too
        while self.turns and min(pool.free_pages(layer) for layer in range(pool.num_layers)) < pool.num_kv_heads * (
                per_head(self.context) + len(self.turns) * per_head(max_new)):
            turn = self.turns.pop()
            self.ops.finish(turn)
            self._close(turn.conv)
        return len(self.turns)

    def _close(self, conv) -> None:
        self.convs.remove(conv)
        self.ops.close(conv)

    def _decode(self, turns) -> None:
        """scheduler._decode: batches of the graphs' size, each turn taking its token."""
        size = self.llm.runner.graph_batch or len(turns)
        for batch in decode_loop.batches(turns, size):
            step = self.ops.decode(batch)
            for turn, row in zip(batch, step.value):
                self.ops.take(turn, row)

    def decode_step(self) -> None:
        self._decode(self.turns)

    def mixed_step(self, size: int) -> None:
        """scheduler._mixed: turns whose decode selects under graphs take a graphed step first; one
        forward carries the others' tokens (with ride_mixed, every turn's) and a slice of the long
        prompt (never its last: a prompt whose next slice would end it is dropped and another begins).
        Adds the ms of the two parts (each ends in the host's read of its tokens) to self.parts."""
        rides = lambda t: self.ride_mixed or mixed.rides_mixed_step(self.llm.runner, t)  # noqa: E731
        riding = [t for t in self.turns if rides(t)]
        graphed = [t for t in self.turns if not rides(t)]
        start = time.perf_counter()
        if graphed:
            self._decode(graphed)
        middle = time.perf_counter()
        if self.long is None or self.long.prefill_left <= size:
            if self.long is not None:
                self.ops.abandon(self.long)
                self._close(self.long.conv)
            self.long = self._begin(1)[1]
        batches = decode_loop.batches(riding, max(1, len(riding)))
        step = self.ops.mixed(batches, [(self.long, size)])
        for batch, rows in zip(batches, step.value[0]):
            for turn, row in zip(batch, rows):
                self.ops.take(turn, row)
        self.parts["graphed_decode_ms"] += (middle - start) * 1000
        self.parts["mixed_forward_ms"] += (time.perf_counter() - middle) * 1000

    def close(self) -> None:
        for turn in self.turns:
            self.ops.finish(turn)
        if self.long is not None:
            self.ops.abandon(self.long)
        for conv in list(self.convs):
            self._close(conv)


def timed(fn, steps: int, sync) -> list[float]:
    out = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - start) * 1000)
    return out


def op_profile(fn, steps: int, sync, cuda: bool) -> dict:
    """torch.profiler over `steps` steps: top-level aten ops (not inside another aten op) per step, by
    name, and device kernels per step, by name, with their device ms per step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync()
    ops, kernels, kernel_us = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name[:80]] += 1
            kernel_us[e.name[:80]] += e.time_range.end - e.time_range.start
            continue
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[e.name] += 1
    per = lambda c: {k: v / steps for k, v in c.most_common()}  # noqa: E731
    return {"torch_ops_per_step": sum(ops.values()) / steps, "kernels_per_step": sum(kernels.values()) / steps,
            "kernel_ms_per_step": sum(kernel_us.values()) / 1000 / steps, "ops": per(ops), "kernels": per(kernels),
            "kernel_ms": {k: v / 1000 / steps for k, v in kernel_us.most_common()}}


def host_profile(fn, steps: int, top: int) -> list[dict]:
    """cProfile over `steps` steps: the `top` functions by own time, with calls per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{path.split('turnkv/')[-1]}:{line}({name})", "calls_per_step": calls / steps,
             "own_ms_per_step": own * 1000 / steps, "cum_ms_per_step": cum * 1000 / steps}
            for (path, line, name), (_, calls, own, cum, _) in rows]


def measure(server: Server, name: str, fn, args, sync, cuda: bool) -> dict:
    for _ in range(args.warmup):
        fn()
    server.parts.clear()
    ms = timed(fn, args.steps, sync)
    row = {"ms_per_step": sum(ms) / len(ms), "ms": ms}
    row.update({k: v / args.steps for k, v in server.parts.items()})  # a mixed step's two parts
    row.update(op_profile(fn, args.profile_steps, sync, cuda))
    row["host"] = host_profile(fn, args.profile_steps, args.top)
    print(f"  {name}: {row['ms_per_step']:.1f} ms/step, {row['torch_ops_per_step']:.0f} torch ops, "
          f"{row['kernels_per_step']:.0f} kernels ({row['kernel_ms_per_step']:.1f} ms on the device) per step",
          flush=True)
    return row


def report(recipe: str, rows: dict, top: int) -> None:
    for kind, row in rows.items():
        print(f"--- {recipe}: {kind} ---")
        print("  torch ops per step: " + ", ".join(f"{k} {v:g}" for k, v in list(row["ops"].items())[:top]))
        if row["kernels"]:
            print("  kernels per step (launches, device ms): " + ", ".join(
                f"{k} {row['kernels'][k]:g} {ms:.3f}" for k, ms in list(row["kernel_ms"].items())[:top]))
        for h in row["host"]:
            print(f"  {h['own_ms_per_step']:8.2f} ms own {h['cum_ms_per_step']:8.2f} cum {h['calls_per_step']:8.1f} "
                  f"calls  {h['function']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a shape name (random weights), a model path, or tiny")
    p.add_argument("--tiny-layers", type=int, default=TINY.num_layers, help="the tiny model's layers")
    p.add_argument("--tiny-kv-heads", type=int, default=TINY.num_kv_heads, help="the tiny model's KV heads")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--recipes", default="full,lserve", help="comma-separated recipes")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=16384, help="tokens of each conversation's prompt")
    p.add_argument("--slice", type=int, default=2048, help="the prefill slice of a mixed step")
    p.add_argument("--kv-memory", default=None)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps on CUDA too")
    p.add_argument("--graphs-on-cpu", action="store_true",
                   help="on CPU, decode through the CUDA-graph decode's buffers and host planning, without graphs")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--ride-mixed", action="store_true",
                   help="every decoding turn rides the mixed forward, selecting ones too (not the server's rule)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    model = args.model
    if model == "tiny":
        model_config.SHAPES["tiny"] = dataclasses.replace(TINY, num_layers=args.tiny_layers,
                                                          num_kv_heads=args.tiny_kv_heads,
                                                          num_heads=2 * args.tiny_kv_heads)
    llm = turnkv.LLM(model, dtype=getattr(torch, args.dtype), device=args.device, kv_memory=args.kv_memory,
                     prefill_chunk=args.prefill_chunk, cuda_graphs=not args.no_cuda_graphs,
                     max_model_len=args.max_model_len)
    if args.graphs_on_cpu and llm.device.type == "cpu":  # the same steps as the graphs', run eagerly
        llm.runner.graphs = GraphedDecode(llm.model, llm.pool, llm.max_model_len, max_batch=args.batch)
    cuda = llm.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(llm.device)) if cuda else (lambda: None)
    ops = EngineOps(llm)
    steps = args.warmup + args.steps + 2 * args.profile_steps
    figures = {"model": args.model, "dtype": args.dtype, "device": str(llm.device), "batch": args.batch,
               "context": args.context, "slice": args.slice, "graph_batch": llm.runner.graph_batch, "recipes": {}}
    for name in split_recipe_list(args.recipes):
        key = recipe_of(name)
        print(f"{name} ({key}):", flush=True)
        server = Server(llm, ops, key, args.context, seed=0, ride_mixed=args.ride_mixed)
        admitted = server.admit(args.batch, max_new=4 * steps)
        row = {"recipe": key, "admitted": admitted}
        print(f"  {admitted} conversations admitted", flush=True)
        row["decode"] = measure(server, "decode step", server.decode_step, args, sync, cuda)
        row["mixed"] = measure(server, "mixed step", lambda: server.mixed_step(args.slice), args, sync, cuda)
        report(name, {"decode": row["decode"], "mixed": row["mixed"]}, args.top)
        server.close()
        figures["recipes"][name] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
