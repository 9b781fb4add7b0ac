"""The `turnkv` command: chat, generate, serve, info, methods, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

from turnkv.interrupt import MESSAGE as INTERRUPTED
from turnkv.interrupt import one_line_on_exit

try:  # torch, the server's and the benchmarks' modules: seconds, during which Ctrl-C prints one line
    import numpy as np
    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from turnkv import heap
    from turnkv.bench.cli import add_quality_parser, add_speed_parser
    from turnkv.engine.info import model_info, read_config
    from turnkv.engine.llm import LLM, PREFIX_MODES
    from turnkv.engine.sampling import SamplingParams
    from turnkv.errors import InvalidRequestError, TurnkvError
    from turnkv.methods.listing import methods_text, preset_rows, presets_text
    from turnkv.methods.recipe import Recipe
    from turnkv.methods.registry import describe
    from turnkv.serve.config import API_KEY_ENV, ServeConfig, parse_head_pattern
    from turnkv.serve.server import bind_listener, serve
    from turnkv.sizes import parse_bytes
    from turnkv.version import __version__
except KeyboardInterrupt as interrupt:
    one_line_on_exit(interrupt)
    raise

MB = 1 << 20
_LOADED: list = []  # the engines this command built
DEFAULT_REPLY_TOKENS = SamplingParams.max_new_tokens  # a reply's length limit when the command line sets none
CHAT_COMMANDS = {
    "/help": "list these commands",
    "/stats": "the conversation's KV: tokens held per layer and head, bytes, the pool, the last compression",
    "/reset": "forget every turn and free the KV",
    "/quit": "leave (also /exit, or end of input)",
}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default where it has one and its help does not already name it."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] or (
            action.default == argparse.SUPPRESS)
        if not action.option_strings or "default" in text or unset or isinstance(action, argparse._VersionAction):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows the defaults; subcommands' parsers are of the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value}")
    return value


@contextmanager
def _working(what: str):
    """A spinner with the elapsed time on stderr while the block runs (on a terminal), then one line
    with the time it took."""
    console = Console(stderr=True)
    start = time.perf_counter()
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            progress.add_task(what + "...", total=None)
            yield
    else:
        yield
    console.print(f"{what}: {time.perf_counter() - start:.1f} s", highlight=False)


_MODEL_HELP = {
    "--model": "GGUF file, HF safetensors folder, or shape name (default: embedded SmolLM2-135M-Instruct)",
    "--dtype": "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)",
    "--device": "cpu or cuda (default: cuda when available)",
    "--kv-memory": "KV page pool size, e.g. 2GiB (default: four full contexts on CPU, most of the free memory "
                   "on a GPU)",
    "--kv-dtype": "K/V storage: int8 or fp8 (quantized per token and head), or none (the model dtype, default)",
}


def _model_args(p: argparse.ArgumentParser) -> None:
    for flag, help_text in _MODEL_HELP.items():
        p.add_argument(flag, default=None, help=help_text)
    p.add_argument("--tokenizer", default=None,
                   help="a folder with tokenizer.json or a GGUF file, for a shape name or a model folder without one "
                        "(default: the model's own; shape names borrow the embedded model's)")
    p.add_argument("--recipe", default=None,
                   help="a preset (turnkv methods --presets), a recipe string, or a .json/.yaml file "
                        "(default: full, the whole KV kept)")
    p.add_argument("--budget", type=_positive_int, default=None,
                   help="eviction budget: average tokens kept per KV head (with an evicting --recipe)")
    p.add_argument("--keep-ratio", type=_ratio, default=None,
                   help="eviction budget as the fraction of tokens kept (with an evicting --recipe)")
    p.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="N",
                   help="split the model and its KV over N devices (tensor parallelism): N processes, rank r on "
                        "cuda:r over NCCL (pick the GPUs with CUDA_VISIBLE_DEVICES), or N CPU processes over "
                        "gloo; N divides the query heads and the intermediate size (docs/parallel.md)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"reply length limit (default: {DEFAULT_REPLY_TOKENS}, or what the context has left)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                            "holding this probability; 1 keeps all")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 means all")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable; default: none)")


def _sampling(args) -> dict:
    """The sampling options of the command line. A --max-new-tokens the context has no room for fails
    the turn, as max_tokens does over HTTP; without it, a reply stops at the context's end."""
    limit = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    return {**limit, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "stop": args.stop}


def _check_reply_limit(args, flag: str, value: int | None) -> None:
    """A reply length the model's context cannot hold (`flag` given as `value`), refused from the
    model's config before its weights load."""
    if value is None:
        return
    name, _, config = read_config(args.model)
    context = config.max_position_embeddings
    if value >= context:
        raise InvalidRequestError(f"{flag} {value} does not fit {name}'s context of {context} tokens: a reply "
                                  f"can take at most {context - 1} (the prompt takes at least one)")


def _recipe(args):
    amounts = {k: str(v) for k, v in (("budget", args.budget), ("keep_ratio", args.keep_ratio)) if v is not None}
    if args.recipe is None:
        if amounts:
            flags = " and ".join(f"--{k.replace('_', '-')}" for k in amounts)
            raise InvalidRequestError(f"{flags} {'sets' if len(amounts) == 1 else 'set'} how much an eviction recipe keeps; add one, e.g. --recipe snapkv "
                                      f"or --recipe ada-snapkv (`turnkv methods --presets` lists them)")
        return None
    recipe = Recipe.from_file(args.recipe) if args.recipe.endswith((".json", ".yaml", ".yml")) else Recipe.parse(args.recipe)
    return recipe.with_overrides(amounts) if amounts else recipe


def _load(args, **options):
    recipe = _recipe(args)  # a bad recipe fails before the model loads
    with _working(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'}"):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory,
                  tokenizer=args.tokenizer, recipe=recipe, kv_dtype=args.kv_dtype,
                  tensor_parallel=args.tensor_parallel, **options)
    heap.freeze()  # the engine stays until the command ends
    _LOADED.append(llm)  # main() stops a tensor-parallel engine's workers when the command ends
    return llm


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (it may be replaced after set-up)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _show_progress_logs() -> None:
    """The engine's INFO messages (a state strategy calibrating on the first turn, ...) on stderr."""
    logger = logging.getLogger("turnkv")
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _turn_stats(reply) -> str:
    return (f"[{reply.prompt_tokens} new + {reply.cached_tokens} reused tokens | KV {reply.kv_bytes / MB:.1f} MB | "
            f"TTFT {reply.ttft_s * 1000:.0f} ms | {reply.tokens_per_s:.1f} tok/s | {reply.finish_reason}]")


def _tier(llm, where: str | None) -> str:
    """Where a conversation's state is, by the tier names of `serve`'s /metrics and the recipe's
    state=gpu: "gpu" is the KV pool (in host memory on a CPU engine); "cpu" and "disk" the tiers below."""
    if where == "gpu" and llm.device.type != "cuda":
        return "gpu (the KV pool, in host memory on this CPU engine)"
    return where or "nowhere yet (no turn)"


def _conversation_stats(llm, conv) -> str:
    kv = conv.kv
    recipe = str(conv.recipe)
    per_layer = kv.bytes_per_layer() / MB
    pool = llm.pool
    lines = [
        f"turns: {len(conv.turns)}   history: {len(conv.tokens)} tokens   in KV: {kv.next_position} positions",
        (f"KV held: {kv.tokens()} token-heads across {pool.num_layers} layers x {pool.num_kv_heads} KV heads "
         f"= {kv.bytes() / MB:.2f} MB ({llm.kv_bytes_per_token()} B/token dense, KV {pool.kv_dtype_name if pool.quantized else str(pool.dtype).removeprefix('torch.')})"),
        f"per layer: min {per_layer.min():.2f} MB, max {per_layer.max():.2f} MB",
        f"pool: {pool.bytes_in_use() / MB:.1f} MB used of {pool.capacity_bytes() / MB:.0f} MB "
        f"({pool.free_pages(0)} free pages of {pool.page_size} tokens in layer 0)",
        f"recipe: {recipe}",
        f"state: {_tier(llm, conv.location)}",
    ]
    if conv.compression_log:
        last = conv.compression_log[-1]
        heads = np.asarray(last["kept_per_head"])
        lines.append(f"last compression: turn {last['turn']} ({last['event']}), positions {last['span'][0]}-"
                     f"{last['span'][1]}, kept per head: mean {heads.mean():.0f}, min {heads.min()}, max {heads.max()}")
        per_segment = conv.segment_counts().mean(axis=(1, 2))
        lines.append("tokens per head by segment (system, turn 1, ...): " + " ".join(f"{x:.0f}" for x in per_segment))
    evict = conv.recipe.evict
    held_all = kv.tokens() == kv.next_position * pool.num_layers * pool.num_kv_heads
    if evict is not None and conv.turns and held_all and not conv.compression_log:
        amount = f"budget={evict.budget}" if evict.budget is not None else f"keep_ratio={evict.keep_ratio}"
        lines.append(f"nothing evicted yet: the {kv.next_position} positions held are within {amount} "
                     f"(a budget acts once earlier turns hold more than it per head)")
    return "\n".join(lines)


def _chat_command(message: str, llm, conv) -> bool:
    """Run `message` when it is a chat command (True), or leave it to be sent (False). A message
    that starts with "//" is sent with one "/"."""
    word = message.split()[0]
    if message.startswith("//") or not word[1:].isalpha():
        return False
    if word == "/reset":
        conv.reset()
        print("(conversation reset)", flush=True)
    elif word == "/stats":
        print(_conversation_stats(llm, conv), flush=True)
    elif word == "/help":
        for name, about in CHAT_COMMANDS.items():
            print(f"  {name:<8} {about}")
        print("  A message that starts with '/' is sent when written with '//' ('//etc' sends '/etc').", flush=True)
    else:
        print(f"unknown command {word}; /help lists the commands (start a message with // to send a '/')",
              file=sys.stderr, flush=True)
    return True


def cmd_chat(args) -> int:
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # piped: every line as soon as it is complete
    _show_progress_logs()
    _check_reply_limit(args, "--max-new-tokens", args.max_new_tokens)
    llm = _load(args)
    llm.turn_parts.require_tokenizer()  # a chat needs one: say so now, not at every turn
    conv = llm.conversation(system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        where = llm.device if llm.parallel is None else f"{llm.parallel.size} ranks (rank 0 on {llm.device})"
        print(f"turnkv chat with {llm.name} on {where} ({llm.dtype}). /help for the commands.", flush=True)
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
        if message.startswith("/") and _chat_command(message, llm, conv):
            continue
        message = message[1:] if message.startswith("//") else message
        print("assistant> " if interactive else "", end="", flush=True)
        try:
            for piece in conv.stream(message, **_sampling(args)):
                print(piece, end="", flush=True)
            print(flush=True)
            if not args.quiet_stats:
                print(_turn_stats(conv.last_reply), flush=True)
        except KeyboardInterrupt:
            print("\n(turn interrupted; the conversation is as it was before it)", flush=True)
        except TurnkvError as e:
            print(f"\nerror: {e}", file=sys.stderr, flush=True)
    return 0


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:  # LLM.encode's error, before the model loads
        raise InvalidRequestError("the prompt is empty" + (": stdin gave nothing" if args.prompt is None else ""))
    _check_reply_limit(args, "--max-new-tokens", args.max_new_tokens)
    llm = _load(args)
    reply = llm.generate(prompt, **_sampling(args))
    print(reply.text)
    print(_turn_stats(reply), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         served_model_name=args.served_model_name, max_running=args.max_running,
                         max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                         max_step_tokens=args.max_step_tokens, max_body_bytes=args.max_body_bytes,
                         default_max_tokens=args.max_tokens or DEFAULT_REPLY_TOKENS,
                         reuse=not args.no_reuse, drain_timeout_s=args.drain_timeout,
                         background_packs=not args.inline_packs, resident_packs=not args.leave_after_turn,
                         head_patterns=dict(args.head_pattern or []),
                         warmup={"auto": None, "on": True, "off": False}[args.warmup])

    _check_reply_limit(args, "--max-tokens", args.max_tokens)
    # The address is taken before the model loads (a port in use fails at once) and handed to uvicorn.
    listener = bind_listener(config.host, config.port)
    try:
        # _load's engine plus the state tiers idle conversations move to when the KV pool fills.
        prefix_cache = "off" if args.no_prefix_cache else args.prefix_cache
        llm = _load(args, prefix_cache=prefix_cache, prefix_cache_memory=args.prefix_cache_memory,
                    state_cpu_memory=args.state_cpu_memory, state_disk_dir=args.state_disk_dir,
                    state_disk_memory=args.state_disk_memory)
        serve(llm, config, idle_ttl_s=args.idle_ttl, log_level=args.log_level, tiers=None if args.no_tiers else "state",
              listener=listener)
    finally:
        listener.close()
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
    width = max(60, min(120, os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 100))
    if args.json:
        print(json.dumps(preset_rows() if args.presets else describe(), indent=2, default=str))
    else:
        print(presets_text(width) if args.presets else methods_text(width))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="turnkv", description="An engine for long multi-turn LLM conversations.")
    parser.add_argument("--version", action="version",
                        version=f"turnkv {__version__} (torch {torch.__version__}, "
                                f"CUDA {torch.version.cuda or 'not built in'})")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (reads turns from stdin when piped)")
    _model_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--quiet-stats", action="store_true", help="leave out the stats line after each reply")
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="complete one raw prompt")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    _model_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    methods = sub.add_parser("methods", help="list every method with its parameters, or the presets")
    methods.add_argument("--presets", action="store_true", help="list the named recipes")
    methods.add_argument("--json", action="store_true", help="print the list as JSON")
    methods.set_defaults(func=cmd_methods)

    bench = sub.add_parser("bench", help="benchmarks: quality, speed")

    suites = bench.add_subparsers(dest="suite", required=True)
    add_quality_parser(suites)
    add_speed_parser(suites)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server that keeps conversations between requests")
    _model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or set TURNKV_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    srv.add_argument("--max-running", type=int, default=32,
                     help="ceiling on requests running together; under it, those the KV pool holds run")
    srv.add_argument("--max-waiting", type=int, default=64, help="queued requests; beyond that 429 + Retry-After")
    srv.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill slice")
    srv.add_argument("--max-step-tokens", type=int, default=2048,
                     help="tokens per forward while requests decode: their next tokens plus whole prefill slices "
                          "(at least one); 0 runs each slice as its own forward between decode steps")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body; beyond it 413")
    srv.add_argument("--max-tokens", type=_positive_int, default=None,
                     help=f"reply length when a request sets no max_tokens (default: {DEFAULT_REPLY_TOKENS}, or what "
                          f"the context has left)")
    srv.add_argument("--no-reuse", action="store_true",
                     help="prefill every request from scratch (a baseline): no request takes KV from a kept "
                          "conversation or from the prefix index")
    srv.add_argument("--idle-ttl", type=float, default=None, help="drop conversations idle this many seconds")
    srv.add_argument("--drain-timeout", type=float, default=30.0, help="seconds admitted requests get on SIGTERM")
    srv.add_argument("--state-cpu-memory", default="1GiB",
                     help="CPU tier for idle conversations evicted from the KV pool "
                          "(default 1GiB; allocated at the warm-up, see --warmup, or else on first use)")
    srv.add_argument("--state-disk-dir", default=None,
                     help="disk tier under the CPU tier; SIGTERM writes idle conversations there, and a server "
                          "started over it continues them (one server per directory)")
    srv.add_argument("--state-disk-memory", default=None, help="cap on the disk tier, e.g. 20GiB (default: none)")
    srv.add_argument("--prefix-cache", choices=PREFIX_MODES, default="turns",
                     help="what the prefix index shares between conversations of a recipe: 'turns' system prompts "
                          "and, under recipes that keep the KV of every token they saw (full, lserve, ...), every "
                          "turn's end, which a request carrying earlier turns takes instead of prefilling them "
                          "(reply KV written by decode steps: a fresh prefill matches it up to rounding); 'system' "
                          "system prompts only (replies bitwise the same as 'off'); 'off' no index")
    srv.add_argument("--no-prefix-cache", action="store_true", help="the same as --prefix-cache off")
    srv.add_argument("--prefix-cache-memory", default=None,
                     help="cap on the prefix index's pages, e.g. 2GiB (default: a quarter of the KV pool)")
    srv.add_argument("--inline-packs", action="store_true",
                     help="pack a conversation that leaves the GPU after its turn (state=krul, load, ...) inside the "
                          "turn's end, on the worker, instead of on a thread of its own beside the running streams "
                          "(a baseline: every running stream waits for the pack)")
    srv.add_argument("--leave-after-turn", action="store_true",
                     help="a conversation packed after its turn (state=krul, load, ...) leaves the GPU as soon as its "
                          "pack lands, instead of staying there with a copy in the CPU tier until the KV pool needs its "
                          "pages (one GPU; tensor-parallel servers always leave)")
    srv.add_argument("--warmup", choices=("auto", "on", "off"), default="auto", help="run synthetic conversations "
                     "before taking requests, so kernels compile before users wait for them (auto: on CUDA)")
    srv.add_argument("--no-tiers", action="store_true",
                     help="drop idle conversations evicted from the KV pool instead of moving them to the tiers")
    srv.add_argument("--head-pattern", action="append", type=parse_head_pattern, metavar="NAME=PATH",
                     help="a head-pattern file requests may name in a recipe (streaming_heads(pattern=NAME)); "
                          "repeatable. A recipe sent over HTTP reads no other file")
    srv.add_argument("--log-level", default="info", help="uvicorn's log level: debug, info, warning, error")
    srv.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="model shape, parameters, KV bytes per token and the largest context that "
                                       "fits a memory, read from the config alone (no weights are built)")
    for flag in ("--model", "--dtype", "--device", "--kv-memory", "--kv-dtype"):
        info.add_argument(flag, default=None, help=_MODEL_HELP[flag])
    info.add_argument("--memory", default="80GiB", help="memory for weights + KV (default 80GiB: one H100)")
    info.add_argument("--json", action="store_true", help="print the figures as JSON")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status. Errors turnkv
    raises on purpose and files that cannot be read or written end the command with one line on
    stderr and status 2, an interrupt with status 130."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (TurnkvError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        while _LOADED:
            _LOADED.pop().shutdown()


if __name__ == "__main__":
    sys.exit(main())
