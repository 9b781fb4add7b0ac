"""Decode with a selection (Quest, LServe, LoopServe) replayed from CUDA graphs: ms per decode token
of dense, quest, lserve (streaming heads, pattern=random), lserve-dynamic and loopserve-d,
Llama-3.1-8B shape with random weights in bf16, batch 1 and 8, contexts 32768 / 65536 / 129536 (rows
whose KV does not fit the GPU are skipped), each beside its floor. Also, at the longest context,
LServe's selector alone against its sparse attention (each captured in a graph of all layers,
replayed), and before anything else a correctness check at a small context: the graphed steps
against the eager ones, fed the same tokens.

Each row runs the engine's own turn (engine/turn.py and the step loop of engine/decode_loop.py, as
LLM.generate runs it): prefill with the recipe, then `--warmup` + `--steps` greedy tokens; the time
per token is taken over the steps that made the last `--steps` tokens (from the times the tokens
were read), after the graph captures and LoopServe's warm-up; 48 steps hold whole re-selection
periods of LoopServe (16) and LServe (4).

Floors (bytes a step must read / copy bandwidth measured here): weights + what the step reads of
the KV: dense every token; quest / lserve the selected pages per row (query heads) plus the page
statistics read by each selection, amortised over its reuse; loopserve-d the budget + the tokens
since the re-selection per row plus one read of every key per re-selection, amortised over n_d.

Usage: python benchmarks/sparse/gpu_decode_selection.py [--contexts 32768,65536,129536] [--batches 1,8]
       [--recipes dense,quest,lserve,lserve-dynamic,loopserve-d] [--out DIR]
       python benchmarks/sparse/gpu_decode_selection.py --smoke     # CPU: tiny shape, the graphs' steps run eagerly
Prints a table last; JSON to --out (or $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

import turnkv
from turnkv.attention import decode as decode_module
from turnkv.attention import top_k as top_k_module
from turnkv.bench import hardware
from turnkv.bench.floors import decode_kv_read_bytes
from turnkv.engine import graph_progressive, graph_selection
from turnkv.engine.conversation import Conversation
from turnkv.errors import KVCacheFullError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.selector import graph_page_scores
from turnkv.methods.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.gpu_timing import time_graphed  # noqa: E402

RECIPES = {
    "dense": "",
    "quest": "quest",
    "lserve": "lserve prefill=streaming_heads(pattern=random)",
    "lserve-dynamic": "lserve-dynamic",
    "loopserve-d": "loopserve-d",
    "loopserve-d-eager": "loopserve-d",  # its re-selections run as eager steps (the fallback)
    # The per-KV-head options (choices the papers leave open: one selection serves the query group,
    # a quarter of the reads for Llama-3.1-8B's groups of 4); not the papers' defaults.
    "loopserve-d-kv": "loopserve-d decode=loopserve(granularity=kv)",
    "lserve-kv": "lserve prefill=streaming_heads(pattern=random) decode=lserve(group=max)",
}
# --smoke: budgets scaled to contexts of a few hundred tokens, so that every recipe selects.
SMOKE_RECIPES = {
    "dense": "",
    "quest": "decode=quest(budget=64)",
    "lserve": "lserve prefill=streaming_heads(pattern=random,sink=16,local=32) decode=lserve(budget=128)",
    "lserve-dynamic": "decode=lserve(budget=128)",
    "loopserve-d": "loopserve-d decode=loopserve(budget=64,warmup=4,interval=4)",
    "loopserve-d-eager": "loopserve-d decode=loopserve(budget=64,warmup=4,interval=4)",
    "loopserve-d-kv": "loopserve-d decode=loopserve(budget=64,warmup=4,interval=4,granularity=kv)",
    "lserve-kv": "lserve prefill=streaming_heads(pattern=random,sink=16,local=32) decode=lserve(budget=128,group=max)",
}
ORDER = ["dense", "quest", "lserve-dynamic", "loopserve-d", "loopserve-d-eager", "loopserve-d-kv", "lserve-kv", "lserve"]


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 32000), (n,), generator=gen).tolist()


def clone(llm, src: SequenceKV) -> SequenceKV:
    """A new conversation holding a copy of src's KV (pages, positions)."""
    dst = SequenceKV(llm.pool)
    dst_slots = dst.reserve_layout(src.lengths, src.next_position)
    ps, D = llm.pool.page_size, llm.pool.head_dim
    table = src.device_table()
    for layer, slots in enumerate(dst_slots):
        counts = torch.from_numpy(src.lengths[layer]).to(llm.device)
        heads = torch.repeat_interleave(torch.arange(len(counts), device=llm.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        index = torch.arange(heads.numel(), device=llm.device) - torch.repeat_interleave(starts, counts)
        src_slots = table[layer, heads, index // ps] * ps + index % ps
        for t in (llm.pool.k, llm.pool.v):
            flat = t[layer].view(-1, D)
            flat.index_copy_(0, slots, flat.index_select(0, src_slots))
        for t in (llm.pool.positions, llm.pool.attention_mass):
            flat = t[layer].view(-1)
            flat.index_copy_(0, slots, flat.index_select(0, src_slots))
    return dst


def start(llm, recipe: Recipe, seqs: list[SequenceKV], ctx: int):
    states = [recipe.new_state(llm.config.num_layers) for _ in seqs]
    for seq, st in zip(seqs, states):
        recipe.after_prompt(seq, st, ctx, llm.model.inv_freq, turn=1)  # LServe: trims streaming heads
    return states


def decode_steps(llm, recipe, seqs, states, tokens, n: int, forced: list | None = None):
    """n decode steps of the graphed-against-eager check, fed the same tokens (greedy, or `forced`).
    -> last tokens, logits."""
    contexts = [st.context for st in states]
    out = []
    for i in range(n):
        if forced is not None:
            tokens = forced[i]
        logits = llm.runner.decode(seqs, tokens, contexts)
        for seq, st in zip(seqs, states):
            recipe.after_decode_step(seq, st, llm.model.inv_freq, turn=1)
        tokens = logits.argmax(-1)
        out.append(logits.float())
    return tokens, out


def count_eager(llm):
    """Wrap runner.forward to count eager decode steps. -> (counter list, undo)."""
    calls = []
    real = llm.runner.forward

    def forward(*args, **kwargs):
        if kwargs.get("decoding"):
            calls.append(1)
        return real(*args, **kwargs)

    llm.runner.forward = forward
    return calls, lambda: llm.runner.__dict__.pop("forward", None)


def correctness(llm, recipes: dict, ctx: int, steps: int) -> list[dict]:
    """Graphed steps against eager steps fed the same tokens, per selecting recipe."""
    rows = []
    base = SequenceKV(llm.pool)
    llm.runner.prefill(base, prompt(ctx, llm.config.vocab_size, 123))
    try:
        for name in ORDER:
            if name not in recipes or name == "dense":
                continue
            graph_progressive.RESCORE_IN_GRAPH = name != "loopserve-d-eager"
            recipe = Recipe.parse(recipes[name])
            seq = clone(llm, base)
            try:
                states = start(llm, recipe, [seq], ctx)
                first = torch.tensor([7], device=llm.device)
                calls, undo = count_eager(llm)
                _, graphed = decode_steps(llm, recipe, [seq], states, first, steps)
                undo()
                eager_steps = len(calls)
                forced = [first] + [x.argmax(-1) for x in graphed[:-1]]
            finally:
                seq.free()
            seq = clone(llm, base)
            graphs, llm.runner.graphs = llm.runner.graphs, None
            try:
                states = start(llm, recipe, [seq], ctx)
                _, eager = decode_steps(llm, recipe, [seq], states, first, steps, forced=forced)
            finally:
                llm.runner.graphs = graphs
                seq.free()
            diff = max((a - b).abs().max().item() for a, b in zip(graphed, eager))
            scale = max(b.abs().max().item() for b in eager)
            same = [bool(a.argmax() == b.argmax()) for a, b in zip(graphed, eager)]
            diffs = [(a - b).abs().max().item() for a, b in zip(graphed, eager)]
            row = {"recipe": name, "context": ctx, "steps": steps, "max_abs_logit_diff": diff, "logit_scale": scale,
                   "argmax_agreement": sum(same) / steps, "first_argmax_mismatch": same.index(False) if False in same else None,
                   "logit_diff_per_step": [round(x, 4) for x in diffs], "eager_steps_in_graphed_run": eager_steps}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        base.free()
    return rows


def floor_bytes(llm, recipe: Recipe, ctx: int, batch: int, weight_bytes: int) -> int:
    kept = ctx * llm.config.kv_bytes_per_token(llm.dtype.itemsize)
    return int(weight_bytes + batch * decode_kv_read_bytes(recipe, llm.config, llm.dtype.itemsize, ctx, kept))


def run_turns(llm, recipe: Recipe, prompts: list[list[int]], new_tokens: int):
    """One turn per prompt through the engine's turn driver and step loop (TurnParts.run_prompts, as
    LLM.generate runs them); the conversations stay open (their selection state is read afterwards).
    -> (replies, convs)."""
    convs = [Conversation(llm, None, recipe) for _ in prompts]
    try:
        parts = llm.turn_parts
        return parts.run_prompts(convs, prompts, parts.sampling_params(max_new_tokens=new_tokens, ignore_eos=True)), convs
    except BaseException:
        for c in convs:
            c.close()
        raise


def time_recipe(llm, name, recipe_text, ctx, batch, args, hw) -> dict:
    recipe = Recipe.parse(recipe_text)
    graph_progressive.RESCORE_IN_GRAPH = name != "loopserve-d-eager"
    prompts = [prompt(ctx, llm.config.vocab_size, ctx + b) for b in range(batch)]
    calls, undo = count_eager(llm)
    try:
        replies, convs = run_turns(llm, recipe, prompts, args.warmup + args.steps)
    finally:
        undo()
    try:
        times = replies[0].token_times
        ms = 1000 * (times[-1] - times[args.warmup - 1]) / args.steps  # the steps making the last `steps` tokens
        floor = floor_bytes(llm, recipe, ctx, batch, hw["weight_bytes"]) / hw["copy_bandwidth"] * 1000
        stats = [c.method_state.decode for c in convs if c.method_state.decode is not None]
        row = {"recipe": name, "context": ctx, "batch": batch, "ms_per_token": ms, "floor_ms": floor,
               "floor_share": floor / ms, "ttft_s": replies[0].ttft_s, "eager_steps": len(calls),
               "timed_steps": args.steps,
               "selections": getattr(stats[0], "selections", None) if stats else None}  # every layer
        if args.selector_at == ctx and batch == 1 and name in ("lserve", "lserve-dynamic"):
            try:
                row["selector"] = selector_vs_attention(llm, [c.method_state for c in convs], ctx, name)
            except Exception:
                row["selector"] = {"recipe": name, "error": traceback.format_exc()[-1500:]}
    finally:
        for c in convs:
            c.close()
    return row


def selector_vs_attention(llm, states, ctx: int, label: str, reps: int = 20) -> dict | None:
    """LServe's in-graph selector against its sparse attention at batch 1, right after the recipe's
    timed steps (its buffers hold a live selection). Each part is captured in a graph of every
    selecting layer and replayed: selector = scores + top-k + commit + expansion of the layer's rows
    (what a selecting step adds); expand = the expansion of every layer at once (what a reusing step
    adds); attention = the indexed decode over the selected pages."""
    graphs = llm.runner.graphs
    if graphs is None or llm.device.type != "cuda":
        return None
    handler = graph_selection.for_graphs(graphs).handler([states[0].decode])
    kw = max(k[2] for k in handler.graphs_by_key if k[1] != "dense")
    L, cfg = llm.config.num_layers, handler.config
    q = graphs.queries[:, :1]
    D = llm.config.head_dim
    splits = decode_module.num_splits(llm.device, handler.R, kw * handler.r * llm.pool.page_size,
                                      selected=True)
    ws = (torch.empty(llm.config.num_heads * splits * D, device=llm.device),
          torch.empty(llm.config.num_heads * splits, device=llm.device))
    tables, lengths = handler.expand(slice(None), 1, kw)

    def selector():
        for layer in range(cfg.dense_layers, L):
            handler.select(layer, q[layer], 1, kw)

    def layer_scores(layer):
        return graph_page_scores(q[layer], handler.summaries.kmax[layer], handler.summaries.kmin[layer],
                                 graphs.tables[layer, :1], graphs.lengths[layer, :1], handler.num_phys, cfg,
                                 llm.pool.page_size)

    def scores():
        for layer in range(cfg.dense_layers, L):
            layer_scores(layer)

    layer_scores_once = [layer_scores(layer) for layer in range(L)]

    def top_k():
        for layer in range(cfg.dense_layers, L):
            top_k_module.top_k_candidates(layer_scores_once[layer], handler.K)

    def expand():
        handler.expand(slice(None), 1, kw)

    def attention():
        for layer in range(cfg.dense_layers, L):
            decode_module.indexed_decode(q[layer], llm.pool.k[layer], llm.pool.v[layer], tables[layer], lengths[layer],
                                         splits, workspace=ws)

    out = {"recipe": label, "context": ctx, "reuse": cfg.reuse_interval}
    # selector = scores + top_k + the merge, commit and expansion of the rows (in one kernel).
    for part, fn in (("selector", selector), ("scores", scores), ("top_k", top_k), ("expand", expand),
                     ("attention", attention)):
        out[f"{part}_ms"] = time_graphed(fn, calls=1, repeat=reps, warmup=1, back_to_back=True) * 1e3
    out["selector_amortised_ms"] = out["selector_ms"] / cfg.reuse_interval
    out["selector_over_attention"] = out["selector_amortised_ms"] / out["attention_ms"]  # target < 0.5
    print(json.dumps(out), flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--contexts", default="32768,65536,129536")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (captures, LoopServe's warm-up)")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--check-context", type=int, default=8192)
    p.add_argument("--check-steps", type=int, default=36)
    p.add_argument("--kv-memory", default=None, help="KV pool size; by default what the largest row needs "
                   "(the rest of the GPU stays free for prefill's activations)")
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random shape, small contexts and budgets")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/sparse/results")
    args = p.parse_args()
    recipes = RECIPES
    if args.smoke:
        args.device, args.shape, args.dtype = "cpu", "smollm2-135m", "float32"
        args.contexts, args.batches = "300", "1,2"
        args.warmup, args.steps, args.check_context, args.check_steps = 6, 8, 300, 12
        args.kv_memory, args.max_model_len = "1GiB", 1024
        recipes = SMOKE_RECIPES
    names = [n for n in args.recipes.split(",") if n]
    recipes = {n: recipes[n] for n in names}
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    rows = max(int(c) * int(b) for c in args.contexts.split(",") for b in args.batches.split(","))
    tokens = max(rows, args.check_context) + 8 * (args.warmup + args.steps + 64)

    def kv_memory(config, dtype):  # the largest row and no more, as `turnkv bench speed` sizes it
        return int(tokens * config.kv_bytes_per_token(dtype.itemsize) * 1.1) + (64 << 20)

    llm = turnkv.LLM(args.shape, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory or kv_memory,
                     max_model_len=args.max_model_len)
    if args.smoke:  # the graphs' steps without graphs, as the CPU tests run them
        from turnkv.engine.cuda_graphs import GraphedDecode

        llm.runner.graphs = GraphedDecode(llm.model, llm.pool, llm.max_model_len, max_batch=8)
    hw = {"device": torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu",
          "copy_bandwidth": hardware.copy_bandwidth(llm.device),
          "weight_bytes": sum(t.numel() * t.element_size() for t in llm.model.parameters())}
    result = {"command": "python benchmarks/sparse/gpu_decode_selection.py " + " ".join(sys.argv[1:]), "shape": args.shape,
              "dtype": args.dtype, **hw, "graphs": llm.runner.graphs is not None,
              "recipes": recipes, "check": [], "rows": [], "selector": []}
    print(json.dumps({k: v for k, v in result.items() if k not in ("check", "rows", "selector")}), flush=True)
    path = os.path.join(args.out, "gpu_decode_selection.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["check"] = correctness(llm, recipes, args.check_context, args.check_steps)
    save()
    contexts = [int(c) for c in args.contexts.split(",")]
    args.selector_at = max(contexts)
    for ctx in contexts:
        for batch in (int(b) for b in args.batches.split(",")):
            need = batch * -(-(ctx + args.warmup + args.steps + 64) // llm.pool.page_size) * llm.config.num_kv_heads
            if need > llm.pool.free_pages(0):
                row = {"context": ctx, "batch": batch, "skipped": f"KV does not fit: {need} pages per layer, "
                                                                  f"{llm.pool.free_pages(0)} free"}
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                continue
            for name in ORDER:
                if name not in recipes:
                    continue
                try:
                    row = time_recipe(llm, name, recipes[name], ctx, batch, args, hw)
                except KVCacheFullError as e:
                    row = {"recipe": name, "context": ctx, "batch": batch, "skipped": str(e)[:120]}
                except Exception:
                    row = {"recipe": name, "context": ctx, "batch": batch, "error": traceback.format_exc()[-1500:]}
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                save()
            if llm.device.type == "cuda":
                torch.cuda.empty_cache()
    result["selector"] = [r["selector"] for r in result["rows"] if r.get("selector")]
    targets(result)
    save()
    report(result)


def targets(result):
    rows = [r for r in result["rows"] if "ms_per_token" in r and r["batch"] == 1]
    at = {(r["recipe"], r["context"]): r["ms_per_token"] for r in rows}
    contexts = sorted({r["context"] for r in rows})
    if not contexts:
        return
    lo, hi = contexts[0], contexts[-1]
    out = {}
    if ("lserve", lo) in at and ("lserve", hi) in at:
        out["lserve_flatness"] = at[("lserve", hi)] / at[("lserve", lo)]  # target <= 1.25
    for name, goal in (("lserve", 1.8), ("loopserve-d", 1.7), ("quest", None), ("lserve-dynamic", None)):
        if (name, hi) in at and ("dense", hi) in at:
            out[f"{name}_speedup_vs_dense_at_{hi}"] = at[("dense", hi)] / at[(name, hi)]
            if goal:
                out[f"{name}_speedup_goal"] = goal
    loop = [r for r in rows if r["recipe"] == "loopserve-d" and r["context"] == hi]
    if loop:
        out["loopserve_d_over_floor"] = loop[0]["ms_per_token"] / loop[0]["floor_ms"]  # target <= 1.3
    for s in result.get("selector", []):
        if "selector_over_attention" in s:
            out[f"{s['recipe']}_selector_amortised_over_attention"] = s["selector_over_attention"]  # target < 0.5
    result["targets"] = out


def report(result):
    print(f"\n{result['shape']} {result['dtype']} on {result['device']}; copy {result['copy_bandwidth'] / 1e9:.0f} GB/s; "
          f"graphs {result['graphs']}")
    for c in result["check"]:
        print(f"check {c['recipe']:>15} ctx {c['context']}: max |logit diff| {c['max_abs_logit_diff']:.3g} "
              f"(scale {c['logit_scale']:.3g}), argmax agreement {c['argmax_agreement']:.2f}, eager steps in the "
              f"graphed run {c['eager_steps_in_graphed_run']}")
    for s in result.get("selector", []):
        if "selector_ms" in s:
            print(f"selector {s['recipe']} ctx {s['context']}: selector {s['selector_ms']:.3f} ms per selection "
                  f"({s['selector_amortised_ms']:.3f} amortised over {s['reuse']}), expansion {s['expand_ms']:.3f} ms, "
                  f"sparse attention {s['attention_ms']:.3f} ms: ratio {s['selector_over_attention']:.2f} (target < 0.5)")
    dense = {(r["context"], r["batch"]): r["ms_per_token"] for r in result["rows"]
             if r.get("recipe") == "dense" and "ms_per_token" in r}
    print(f"{'context':>8} {'batch':>5} {'recipe':>15} {'ms/token':>9} {'x dense':>8} {'floor ms':>9} "
          f"{'of floor':>8} {'eager':>6}")
    for r in result["rows"]:
        if "ms_per_token" not in r:
            why = r.get("skipped") or (r.get("error") or "").strip().splitlines()[-1:]
            print(f"{r['context']:>8} {r['batch']:>5} {r.get('recipe', '-'):>15}  {why}")
            continue
        base = dense.get((r["context"], r["batch"]))
        print(f"{r['context']:>8} {r['batch']:>5} {r['recipe']:>15} {r['ms_per_token']:9.2f} "
              f"{base / r['ms_per_token'] if base else float('nan'):8.2f} {r['floor_ms']:9.2f} "
              f"{r['floor_share']:8.2f} {r['eager_steps']:>6}")
    print("targets:", json.dumps(result.get("targets", {})))


if __name__ == "__main__":
    main()
