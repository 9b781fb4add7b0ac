"""The worker's steps with and without a second busy Python thread in the process (the server's HTTP
loop and encoder share the worker's interpreter). Per recipe: --n conversations of --context tokens
are prefilled; then each cycle begins a later turn of --new tokens in --slices of them, runs the
slices in one mixed forward (the server's seam, turnkv/serve/engine_ops.py), the after-prompt hook,
three decode steps and the turns' end. Cycles run first alone, then beside a thread busy --busy of
the time in bursts of 2 ms. Prints the ms of each part; --out writes them as JSON.

Every Triton launch and CUDA sync lets go of the GIL, and the worker takes it back only when the
other thread lets go in turn, so a step that is bound by its host work slows with the other
thread's load.

    python benchmarks/serving/busy_thread_steps.py --model llama-3.1-8b --dtype bfloat16 --device cuda \\
        --recipes full,lserve --busy 0.5 --out busy_thread_steps.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time

import torch

import turnkv
from turnkv.engine.turn import TurnInput
from turnkv.methods.recipe import Recipe
from turnkv.methods.terms import split_recipe_list, split_top_level
from turnkv.serve.engine_ops import EngineOps

ALIASES = {"lserve": "lserve-random"}


class Busy:
    """A daemon thread of pure Python: `share` of the time in bursts of 2 ms, asleep otherwise."""

    def __init__(self, share: float):
        self.share, self.stop = share, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                sum(range(200))
            time.sleep(0.002 * (1 - self.share) / self.share)

    def __enter__(self):
        if self.share > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.share > 0:
            self.thread.join()


class Conversations:
    def __init__(self, llm, recipe_name: str, n: int, context: int, seed: int = 0):
        self.llm, self.ops = llm, EngineOps(llm)
        tokens = split_top_level(recipe_name)
        self.key = " ".join([ALIASES.get(tokens[0], tokens[0])] + tokens[1:])
        self.recipe = llm.resolve_recipe(Recipe.parse(self.key))
        self.gen = torch.Generator().manual_seed(seed)
        self.sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
        self.convs = []
        for _ in range(n):
            conv = self.ops.new_conversation(self.recipe, self.key)
            self.convs.append(conv)
            turn = self._turn(conv, 0, self._ids(context), 3)
            logits = None
            while logits is None:
                logits = self.ops.prefill(turn, llm.runner.prefill_chunk)
            self.ops.take(turn, logits)
            self.ops.settle(turn)
            self.ops.finish(turn)

    def _ids(self, n: int) -> list[int]:
        return torch.randint(10, self.llm.config.vocab_size - 10, (n,), generator=self.gen).tolist()

    def _turn(self, conv, keep: int, ids: list[int], max_new: int):
        params = self.llm.turn_parts.sampling_params(max_new_tokens=max_new, ignore_eos=True)
        gen = self.llm.turn_parts.new_generation(conv.kv, params)
        first = keep == 0
        return self.ops.begin_turn(conv, TurnInput(keep, ids, len(ids) if first else 0, None, None, "", prefix_end=0),
                                   gen)

    def cycle(self, slices: int, new: int, part=lambda name: contextlib.nullcontext()) -> dict:
        """Later turns of the `slices` least recent conversations: ms of each part. part(name): a
        context each part (forward, settle, decode, finish) runs inside (sync_points.py counts there)."""
        convs = self.convs[:slices]
        self.convs = self.convs[slices:] + convs
        turns = [self._turn(c, c.kv.next_position, self._ids(new), 8) for c in convs]
        marks = []
        mark = lambda: (self.sync(), marks.append(time.perf_counter()))  # noqa: E731
        mark()
        with part("forward"):
            step = self.ops.mixed([], [(t, new) for t in turns])
            for turn, last in zip(turns, step.value[1]):
                self.ops.take(turn, last)
        mark()
        with part("settle"):
            for turn in turns:
                self.ops.settle(turn)
        mark()
        for _ in range(3):
            with part("decode"):
                decoded = self.ops.decode(turns)
                for turn, row in zip(turns, decoded.value):
                    self.ops.take(turn, row)
            mark()
        with part("finish"):
            for turn in turns:
                self.ops.finish(turn)
        mark()
        ms = [(b - a) * 1000 for a, b in zip(marks, marks[1:])]
        return {"forward": ms[0], "settle": ms[1], "decodes": ms[2:5], "finish": ms[5]}


def cycle_arguments(description: str, conversations: int) -> argparse.ArgumentParser:
    """The engine and the cycles' shape, as this script and sync_points.py take them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="llama-3.1-8b", help="a shape name (random weights) or a model path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-memory", default=None)
    p.add_argument("--recipes", default="full,lserve", help="comma-separated presets or recipe strings (Krul's server state: \"full state=krul\")")
    p.add_argument("--n", type=int, default=conversations, help="conversations")
    p.add_argument("--context", type=int, default=16384, help="tokens of each first turn")
    p.add_argument("--new", type=int, default=20, help="tokens of each later turn's prompt")
    p.add_argument("--slices", type=int, default=2, help="later turns in one mixed forward")
    return p


def main(argv=None) -> dict:
    p = cycle_arguments(__doc__.split("\n\n")[0], conversations=8)
    p.add_argument("--busy", type=float, default=0.5, help="the second thread's busy share (0 < busy <= 1)")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not 0 < args.busy <= 1:
        p.error("--busy is a share of the time: 0 < busy <= 1")
    llm = turnkv.LLM(args.model, dtype=getattr(torch, args.dtype), device=args.device, kv_memory=args.kv_memory)
    out = {"model": args.model, "device": str(llm.device), "busy": args.busy, "context": args.context,
           "new": args.new, "slices": args.slices, "recipes": {}}
    for name in split_recipe_list(args.recipes):
        convs = Conversations(llm, name, args.n, args.context)
        for _ in range(args.warmup):
            convs.cycle(args.slices, args.new)
        rows = {}
        for label, share in (("alone", 0.0), ("busy", args.busy)):
            with Busy(share):
                rows[label] = [convs.cycle(args.slices, args.new) for _ in range(args.cycles)]
        median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        for label, cycles in rows.items():
            print(f"{name:8s} {label:5s}: forward {median([c['forward'] for c in cycles]):7.1f} ms, first decode "
                  f"{median([c['decodes'][0] for c in cycles]):6.1f} ms, later decodes "
                  f"{median([c['decodes'][2] for c in cycles]):6.1f} ms", flush=True)
        out["recipes"][name] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
