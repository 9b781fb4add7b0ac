"""Where the worker's steps wait for the GPU. Per recipe, the cycles of busy_thread_steps.py (later
turns of --new tokens in one mixed forward, the after-prompt hook, three decode steps, the turns'
end) run under torch.cuda.set_sync_debug_mode("warn"), and each synchronizing call is counted by
the turnkv lines that made it (the innermost --depth frames). A synchronization inside a forward
stops the host from queueing the next layer while the device runs this one. Prints the sites of each
part, most first; --out writes them as JSON. On a CPU nothing synchronizes: the run only checks that
the script works.

    python benchmarks/serving/sync_points.py --model llama-3.1-8b --dtype bfloat16 --device cuda \\
        --recipes full,lserve --out sync_points.json
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

import turnkv

sys.path.insert(0, str(Path(__file__).parent))
from busy_thread_steps import Conversations, cycle_arguments  # noqa: E402

from turnkv.methods.terms import split_recipe_list  # noqa: E402

MESSAGE = "synchronizing CUDA operation"


def site(stack: list, depth: int) -> str:
    """The innermost `depth` turnkv frames of a stack, innermost first ("file:line function")."""
    ours = [f for f in stack if "/turnkv/" in f.filename.replace("\\\\", "/")]
    return " < ".join(f"{f.filename.split('turnkv/')[-1]}:{f.lineno} {f.name}" for f in ours[-depth:][::-1]) or "?"


class SyncSites:
    """Counts the synchronizing calls made inside part(name) by site, on a CUDA device."""

    def __init__(self, device: torch.device, depth: int = 3):
        self.cuda, self.depth = device.type == "cuda", depth
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def record(self, name: str, message: str, stack: list) -> None:
        if MESSAGE in message:
            self.counts[name][site(stack, self.depth)] += 1

    @contextlib.contextmanager
    def part(self, name: str):
        if not self.cuda:
            yield
            return
        def show(message, category, filename, lineno, file=None, line=None):
            self.record(name, str(message), traceback.extract_stack()[:-1])

        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> dict:
    p = cycle_arguments(__doc__.split("\n\n")[0], conversations=4)
    p.add_argument("--cycles", type=int, default=2, help="cycles counted, after one uncounted")
    p.add_argument("--depth", type=int, default=3, help="turnkv frames that name a site")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    llm = turnkv.LLM(args.model, dtype=getattr(torch, args.dtype), device=args.device, kv_memory=args.kv_memory)
    out = {"model": args.model, "device": str(llm.device), "context": args.context, "new": args.new,
           "slices": args.slices, "cycles": args.cycles, "recipes": {}}
    for name in split_recipe_list(args.recipes):
        convs = Conversations(llm, name, args.n, args.context)
        convs.cycle(args.slices, args.new)  # compiles and graphs: not counted
        sites = SyncSites(llm.device, args.depth)
        for _ in range(args.cycles):
            convs.cycle(args.slices, args.new, sites.part)
        per_part = {part: dict(c.most_common()) for part, c in sites.counts.items()}
        out["recipes"][name] = per_part
        print(f"{name}: synchronizations per cycle by part: " + ", ".join(
            f"{part} {sum(c.values()) / args.cycles:.1f}" for part, c in per_part.items()), flush=True)
        for part, c in per_part.items():
            for where, n in list(c.items())[:8]:
                print(f"    {part:8s} {n / args.cycles:6.1f}  {where}", flush=True)
        if args.out:  # after each recipe: a later one's failure keeps the counts made so far
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
