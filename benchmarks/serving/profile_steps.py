"""Where a serving step's time goes: one batch of decoding conversations under a recipe, stepped
from the CUDA graphs (in batches the graphs hold), eagerly in one batch, and as mixed steps that also
carry a slice of a long prompt; then the host profile of the eager and mixed steps.

    python benchmarks/serving/profile_steps.py --model llama-3.1-8b --dtype bfloat16 --device cuda \
        --recipe "ada-snapkv keep_ratio=0.1 schedule=prompt" --batch 64 --prompt 32768 --kv-memory 56GiB

A diagnostic: the capacity benchmark (capacity_bench.py) gives the serving figures."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import turnkv
from turnkv.engine import decode_loop, mixed
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun


def new_turn(llm, ids: list[int], max_new: int) -> TurnRun:
    conv = Conversation(llm, None, llm.recipe)
    params = llm.turn_parts.sampling_params(max_new_tokens=max_new, ignore_eos=True)
    return TurnRun(conv, TurnInput(0, ids, len(ids), None, None, "", prefix_end=0),
                   llm.turn_parts.new_generation(conv.kv, params)).begin()


def timed(fn, steps: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def host_profile(fn, steps: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--recipe", default="ada-snapkv keep_ratio=0.1 schedule=prompt")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32768, help="tokens of each conversation's prompt")
    p.add_argument("--slice", type=int, default=2048, help="prefill slice of the long prompt in a mixed step")
    p.add_argument("--kv-memory", default="56GiB")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    llm = turnkv.LLM(args.model, dtype=dtype, device=args.device, kv_memory=args.kv_memory, recipe=args.recipe)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    turns = []
    for _ in range(args.batch):
        turn = new_turn(llm, torch.randint(100, vocab - 100, (args.prompt,), generator=gen).tolist(), 10_000)
        turn.take(turn.prefill())
        turns.append(turn)
        if llm.device.type == "cuda":
            print(f"conversation {len(turns)} prefilled: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated",
                  flush=True)
    kept = sum(t.seq.tokens() for t in turns) / args.batch / (llm.config.num_layers * llm.config.num_kv_heads)
    long = new_turn(llm, torch.randint(100, vocab - 100, (args.prompt,), generator=gen).tolist(), 1)
    long.prefill(args.prompt // 2)  # a slice halfway into a long prompt

    graph_batch = llm.runner.graph_batch or args.batch
    figures = {"recipe": str(llm.recipe), "batch": args.batch, "prompt": args.prompt, "kept_tokens_per_head": kept,
               "graph_batch": graph_batch}
    step_graphed = lambda: decode_loop.step(llm, turns, graph_batch)  # noqa: E731
    step_eager = lambda: decode_loop.step(llm, turns, args.batch)  # noqa: E731

    def step_mixed():
        part = mixed.slice_part(long, args.slice)
        rows = mixed.forward(llm.runner, [mixed.decode_part(turns), part])
        for turn, row in zip(turns, rows[0]):
            turn.after_step(row)
        long.seq.truncate(long.seq.next_position - part.width)  # the same slice again next time

    def slice_alone():
        part = mixed.slice_part(long, args.slice)
        mixed.forward(llm.runner, [part])
        long.seq.truncate(long.seq.next_position - part.width)

    later_ids = torch.randint(100, vocab - 100, (args.slice,), generator=gen).tolist()

    def later_turn_slice():
        """A later turn's prompt of --slice tokens over a decoded conversation's kept history."""
        seq = turns[0].seq
        mixed.forward(llm.runner, [mixed.Part([seq], [later_ids], [turns[0].context], False)])
        seq.truncate(seq.next_position - len(later_ids))

    for name, fn in [("graphed_decode_s", step_graphed), ("eager_decode_s", step_eager),
                     ("mixed_step_s", step_mixed), ("slice_alone_s", slice_alone),
                     ("later_turn_slice_s", later_turn_slice)]:
        fn()  # warm-up (graph capture, autotuning)
        figures[name] = timed(fn, args.steps, sync)
        print(f"{name}: {figures[name] * 1000:.1f} ms", flush=True)
    print(json.dumps(figures, indent=1))
    for name, fn in [("eager decode", step_eager), ("mixed step", step_mixed), ("later turn slice", later_turn_slice)]:
        print(f"--- host profile: {name} ---")
        print(host_profile(fn, 3))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
