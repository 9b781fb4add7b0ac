"""The `turnkv` command: chat, generate, serve, info."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from turnkv.bench.cli import add_quality_parser, add_speed_parser
from turnkv.engine.info import model_info
from turnkv.engine.llm import LLM
from turnkv.errors import TurnkvError
from turnkv.methods.evict.eviction import SCHEDULES
from turnkv.methods.recipe import PRESET_DOCS, Recipe, presets
from turnkv.methods.registry import describe
from turnkv.serve.config import API_KEY_ENV, ServeConfig, parse_head_pattern
from turnkv.serve.server import serve
from turnkv.sizes import parse_bytes

MB = 1 << 20


_MODEL_HELP = {
    "--model": "GGUF file, HF safetensors folder, or shape name (default: embedded SmolLM2-135M-Instruct)",
    "--dtype": "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)",
    "--device": "cpu or cuda (default: cuda when available)",
    "--kv-memory": "KV page pool size, e.g. 2GiB",
    "--kv-dtype": "K/V storage: int8 or fp8 (quantized per token and head), or none (the model dtype, default)",
}


def _model_args(p: argparse.ArgumentParser) -> None:
    for flag, help_text in _MODEL_HELP.items():
        p.add_argument(flag, default=None, help=help_text)
    p.add_argument("--tokenizer", default=None, help="tokenizer for a shape name or a folder without one")
    p.add_argument("--recipe", default=None,
                   help="a preset (turnkv methods --presets), a recipe string, or a .json/.yaml file")
    p.add_argument("--budget", type=int, default=None, help="eviction budget: average tokens kept per KV head")
    p.add_argument("--keep-ratio", type=float, default=None, help="eviction budget as the fraction of tokens kept")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def _sampling(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop}


def _recipe(args):

    if args.recipe is None and args.budget is None and args.keep_ratio is None:
        return None
    recipe = Recipe() if args.recipe is None else (
        Recipe.from_file(args.recipe) if args.recipe.endswith((".json", ".yaml", ".yml")) else Recipe.parse(args.recipe))
    amounts = {k: str(v) for k, v in (("budget", args.budget), ("keep_ratio", args.keep_ratio)) if v is not None}
    return recipe.with_overrides(amounts) if amounts else recipe


def _load(args):

    return LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory, tokenizer=args.tokenizer,
               recipe=_recipe(args), kv_dtype=args.kv_dtype)


def _turn_stats(reply) -> str:
    return (f"[{reply.prompt_tokens} new + {reply.cached_tokens} reused tokens | KV {reply.kv_bytes / MB:.1f} MB | "
            f"TTFT {reply.ttft_s * 1000:.0f} ms | {reply.tokens_per_s:.1f} tok/s | {reply.finish_reason}]")


def _conversation_stats(llm, conv) -> str:
    kv = conv.kv
    per_layer = kv.bytes_per_layer() / MB
    pool = llm.pool
    lines = [
        f"turns: {len(conv.turns)}   history: {len(conv.tokens)} tokens   in KV: {kv.next_position} positions",
        (f"KV held: {kv.tokens()} token-heads across {pool.num_layers} layers x {pool.num_kv_heads} KV heads "
         f"= {kv.bytes() / MB:.2f} MB ({llm.kv_bytes_per_token()} B/token dense, KV {pool.kv_dtype_name if pool.quantized else str(pool.dtype).removeprefix('torch.')})"),
        f"per layer: min {per_layer.min():.2f} MB, max {per_layer.max():.2f} MB",
        (f"pool: {pool.bytes_in_use() / MB:.1f} MB used of {pool.capacity_bytes() / MB:.0f} MB "
         f"({pool.free_pages(0)} free pages of {pool.page_size} tokens in layer 0)"),
        f"recipe: {conv.recipe}",
    ]
    if conv.compression_log:
        last = conv.compression_log[-1]
        heads = np.asarray(last["kept_per_head"])
        lines.append(f"last compression: turn {last['turn']} ({last['event']}), positions {last['span'][0]}-"
                     f"{last['span'][1]}, kept per head: mean {heads.mean():.0f}, min {heads.min()}, max {heads.max()}")
        per_segment = conv.segment_counts().mean(axis=(1, 2))
        lines.append("tokens per head by segment (system, turn 1, ...): " + " ".join(f"{x:.0f}" for x in per_segment))
    return "\n".join(lines)


def cmd_chat(args) -> int:
    llm = _load(args)
    conv = llm.conversation(system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"turnkv chat with {llm.name} on {llm.device} ({llm.dtype}). /stats, /reset, /quit.", flush=True)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/quit", "/exit"):
            break
        if message == "/reset":
            conv.reset()
            print("(conversation reset)", flush=True)
            continue
        if message == "/stats":
            print(_conversation_stats(llm, conv), flush=True)
            continue
        print("assistant> " if interactive else "", end="", flush=True)
        try:
            for piece in conv.stream(message, **_sampling(args)):
                print(piece, end="", flush=True)
            print()
            print(_turn_stats(conv.last_reply), file=sys.stderr if args.quiet_stats else sys.stdout, flush=True)
        except KeyboardInterrupt:
            print("\n(turn interrupted; the conversation is as it was before it)", flush=True)
        except TurnkvError as e:
            print(f"\nerror: {e}", file=sys.stderr, flush=True)
    return 0


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = _load(args)
    reply = llm.generate(prompt, **_sampling(args))
    print(reply.text)
    print(_turn_stats(reply), file=sys.stderr)
    return 0


def _head_pattern(spec: str) -> tuple[str, str]:
    try:
        return parse_head_pattern(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(args) -> int:
    import logging
    import os



    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         served_model_name=args.served_model_name, max_running=args.max_running,
                         max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                         max_body_bytes=args.max_body_bytes, default_max_tokens=args.max_tokens,
                         reuse=not args.no_reuse, drain_timeout_s=args.drain_timeout,
                         head_patterns=dict(args.head_pattern or []))

    # _load's engine plus the state tiers idle conversations move to when the KV pool fills.
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory, tokenizer=args.tokenizer,
              recipe=_recipe(args), state_cpu_memory=args.state_cpu_memory, state_disk_dir=args.state_disk_dir,
              state_disk_memory=args.state_disk_memory, kv_dtype=args.kv_dtype)
    serve(llm, config, idle_ttl_s=args.idle_ttl, log_level=args.log_level, tiers=None if args.no_tiers else "state")
    return 0


def cmd_info(args) -> int:
    info = model_info(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype,
                      memory=parse_bytes(args.memory),
                      kv_memory=None if args.kv_memory is None else parse_bytes(args.kv_memory))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value:,}" if isinstance(value, int) else f"{key:<{width}}  {value}")
    return 0


def cmd_methods(args) -> int:

    if args.presets:
        rows = {name: {"recipe": str(recipe), "about": PRESET_DOCS.get(name, "")} for name, recipe in presets().items()}
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for name, row in rows.items():
                print(f"{name:<24} {row['about']}\n{'':<24} {row['recipe']}")
        return 0
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    kind = None
    for row in rows:
        if row["kind"] != kind:
            kind = row["kind"]
            print(f"\n[{kind}]" if kind == row["axis"] else f"\n[{row['axis']}: {kind}]")
        params = ", ".join(f"{k}={v!r}" for k, v in row["params"].items())
        print(f"  {row['name']:<20} {row['doc']}" + (f"\n  {'':<20} ({params})" if params else ""))

    print("\n[evict options] budget=N (tokens per KV head) | keep_ratio=F | compression_ratio=F | every=N")
    for name, doc in SCHEDULES.items():
        print(f"  schedule={name:<10} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnkv", description="An engine for long multi-turn LLM conversations.")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (reads turns from stdin when piped)")
    _model_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--quiet-stats", action="store_true", help="print per-turn stats on stderr")
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="complete one raw prompt")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    _model_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    methods = sub.add_parser("methods", help="list every method with its parameters, or the presets")
    methods.add_argument("--presets", action="store_true", help="list the named recipes")
    methods.add_argument("--json", action="store_true")
    methods.set_defaults(func=cmd_methods)

    bench = sub.add_parser("bench", help="benchmarks: quality, speed")

    suites = bench.add_subparsers(dest="suite", required=True)
    add_quality_parser(suites)
    add_speed_parser(suites)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server that keeps conversations between requests")
    _model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or set TURNKV_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    srv.add_argument("--max-running", type=int, default=32, help="requests decoding together (the decode batch)")
    srv.add_argument("--max-waiting", type=int, default=64, help="queued requests; beyond that 429 + Retry-After")
    srv.add_argument("--prefill-chunk", type=int, default=512, help="prefill slice run between two decode steps")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20)
    srv.add_argument("--max-tokens", type=int, default=256, help="reply length when a request sets no max_tokens")
    srv.add_argument("--no-reuse", action="store_true", help="prefill every request from scratch (a baseline)")
    srv.add_argument("--idle-ttl", type=float, default=None, help="drop conversations idle this many seconds")
    srv.add_argument("--drain-timeout", type=float, default=30.0, help="seconds admitted requests get on SIGTERM")
    srv.add_argument("--state-cpu-memory", default="1GiB",
                     help="CPU tier for idle conversations evicted from the KV pool "
                          "(default 1GiB, allocated on first use)")
    srv.add_argument("--state-disk-dir", default=None,
                     help="disk tier under the CPU tier; SIGTERM writes idle conversations there, and a server "
                          "started over it continues them (one server per directory)")
    srv.add_argument("--state-disk-memory", default=None, help="cap on the disk tier, e.g. 20GiB (default: none)")
    srv.add_argument("--no-tiers", action="store_true",
                     help="drop idle conversations evicted from the KV pool instead of moving them to the tiers")
    srv.add_argument("--head-pattern", action="append", type=_head_pattern, metavar="NAME=PATH",
                     help="a head-pattern file requests may name in a recipe (streaming_heads(pattern=NAME)); "
                          "repeatable. A recipe sent over HTTP reads no other file")
    srv.add_argument("--log-level", default="info")
    srv.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="model shape, parameters, KV bytes per token and the largest context that "
                                       "fits a memory, read from the config alone (no weights are built)")
    for flag in ("--model", "--dtype", "--device", "--kv-memory", "--kv-dtype"):
        info.add_argument(flag, default=None, help=_MODEL_HELP[flag])
    info.add_argument("--memory", default="80GiB", help="memory for weights + KV (default 80GiB: one H100)")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TurnkvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
