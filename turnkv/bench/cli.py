"""`turnkv bench quality`: the command-line front of the quality runner."""

from __future__ import annotations

import functools
import itertools
import json
import shlex
import sys
import time

from turnkv import heap
from turnkv.bench import speed_report
from turnkv.bench.datasets.loaders import load
from turnkv.bench.datasets.tasks import generate
from turnkv.bench.quality import QualityConfig, load_results, run_quality
from turnkv.bench.quality_presets import apply
from turnkv.bench.report import write_report
from turnkv.bench.speed import SpeedConfig, pool_bytes, run_speed
from turnkv.engine.llm import LLM
from turnkv.errors import InvalidRequestError
from turnkv.methods.recipe import Recipe, preset
from turnkv.paths import user_path


def _split(text: str) -> list[str]:
    """Split on commas outside parentheses: recipe strings can hold their own."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        items.append(current.strip())
    return items


def add_quality_parser(sub) -> None:
    p = sub.add_parser("quality", help="multi-turn quality and fidelity of recipes")
    p.add_argument("--model", default=None, help="a model file or folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--kv-memory", default=None, help="KV pool size (default: the engine's)")
    p.add_argument("--kv-dtype", default=None, help="K/V storage of every run: int8, fp8 or none (default)")
    # Flags a preset can set default to None here; quality_presets.apply fills them in.
    p.add_argument("--preset", default=None, help="named settings: smoke (the CI subset) or full (the committed run)")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: all five)")
    p.add_argument("--data", action="append", default=[], help="FORMAT:PATH of a public data file (repeatable)")
    p.add_argument("--recipes", default=None,
                   help="comma-separated presets or recipe strings, each optionally 'LABEL: SPEC' "
                        "(default: snapkv,ada-snapkv)")
    p.add_argument("--policies", default=None, help="turn policies crossed with every evicting recipe (default: recompress)")
    p.add_argument("--budget", type=int, default=None, help="tokens per KV head for every evicting recipe")
    p.add_argument("--keep-ratio", default=None, help="fraction kept; a comma list sweeps several budgets")
    p.add_argument("--positions", default=None, help="default: begin,middle,end")
    p.add_argument("--turns", type=int, default=None, help="default: 3")
    p.add_argument("--n", type=int, default=None, help="instances per task (default: 2)")
    p.add_argument("--context-tokens", type=int, default=None, help="default: 300")
    p.add_argument("--difficulty", type=int, default=None, help="default: 1")
    p.add_argument("--seed", type=int, default=None, help="default: 0")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 48")
    p.add_argument("--no-fidelity", action="store_true",
                   help="skip the teacher-forced runs behind agreement and KL against the full cache")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that split the recipes, each with cores/workers torch threads (default: 1)")
    p.add_argument("--batch", type=int, default=None,
                   help="recipes whose conversations run together, decode steps batched (default: 16)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="run every conversation on its own through the engine's Conversation (slow; the reference "
                        "the batched runner is tested against)")
    p.add_argument("--report-only", action="store_true",
                   help="write the report from what --out/results.jsonl holds (a partial run too), running nothing")
    p.add_argument("--out", default=None, help="default: benchmarks/quality/results/latest, or the preset's folder")
    p.set_defaults(func=cmd_quality)


def add_speed_parser(sub) -> None:
    p = sub.add_parser("speed", help="latency and throughput against the hardware floor and against peers")
    p.add_argument("--model", default=None, help="a model file or folder, or a shape such as llama-3.1-8b")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--kv-memory", default=None, help="KV pool size (default: what the largest case needs)")
    p.add_argument("--kv-dtype", default=None, help="K/V storage: int8, fp8 or none (the model dtype, default)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model and its KV over N devices (rank r on cuda:r over NCCL, or N CPU processes "
                        "over gloo); rank 0 times every row, and speed.json records N and the devices. The peers "
                        "run on one device: their rows are marked unavailable")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths in tokens")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--turns", type=int, default=2, help="later turns timed against kept history")
    p.add_argument("--turn-tokens", default="256",
                   help="new tokens of a later turn; a comma list (e.g. 64,512,4096) times each over the same history")
    p.add_argument("--recipes", default="full", help="comma-separated presets or recipe strings")
    p.add_argument("--peers", default="transformers,sdpa", help="comma-separated; 'none' for none")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure at batch 1 (the median is kept)")
    p.add_argument("--skip-tokens", type=int, default=16,
                   help="decode steps left out of the time per token (a selection's warm-up, graph captures)")
    p.add_argument("--out", default="benchmarks/decode/results/latest",
                   help="folder for rows.jsonl (each row as it finishes; a rerun resumes from it), speed.json, "
                        "report.md and plots")
    p.set_defaults(func=cmd_speed)


def _integers(flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers, or InvalidRequestError naming the flag."""
    try:
        values = [int(item) for item in _split(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InvalidRequestError(f"{flag} takes comma-separated integers >= 1, e.g. 1024,4096; got {text!r}")
    return values


def cmd_speed(args) -> int:

    contexts, batches = _integers("--contexts", args.contexts), _integers("--batch", args.batch)
    recipes = {spec: Recipe.parse(spec) for spec in _split(args.recipes)}  # a bad one fails before the load
    turn_tokens = _integers("--turn-tokens", args.turn_tokens)
    need = max(contexts) + args.new_tokens + args.turns * max(turn_tokens)
    # Room for the largest batch at the largest context, and no more; a partial of a module-level function,
    # since a tensor-parallel engine's arguments reach its workers pickled.
    tokens = max(need, (max(contexts) + args.new_tokens + 16) * max(batches))
    kv_memory = functools.partial(_pool_for, args.kv_dtype, tokens)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory or kv_memory,
              max_model_len=need + 16, kv_dtype=args.kv_dtype, tensor_parallel=args.tensor_parallel)
    try:
        return _speed(args, llm, contexts, batches, recipes, turn_tokens)
    finally:
        llm.shutdown()  # a tensor-parallel engine's workers; nothing on one device


def _speed(args, llm, contexts, batches, recipes, turn_tokens) -> int:
    heap.freeze()  # no full collection of the engine's objects inside a timed step
    config = SpeedConfig(contexts=contexts, batches=batches, new_tokens=args.new_tokens, turns=args.turns,
                         turn_tokens=tuple(turn_tokens), recipes=recipes,
                         peers=tuple(p for p in _split(args.peers) if p != "none"), repeat=args.repeat,
                         skip_tokens=args.skip_tokens)
    rows_path = user_path(args.out) / "rows.jsonl"
    if rows_path.exists():
        print(f"resuming from {rows_path}: its rows are kept, the others measured", file=sys.stderr)
    result = run_speed(llm, config, rows_path=rows_path)
    command = "turnkv bench speed " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    print(speed_report.write(result, args.out, command))
    return 0


def _pool_for(kv_dtype, tokens: int, config, dtype) -> int:
    """kv_memory(config, dtype) of a speed run: a pool of `tokens` tokens of the rank's KV heads."""
    return pool_bytes(config, dtype, kv_dtype, tokens)


def _labelled(item: str) -> tuple[str | None, str]:
    """"LABEL: SPEC" -> (LABEL, SPEC); a plain spec -> (None, spec). Labels name settings of a recipe
    that its string would name badly ("a-shape@256: prefill=a_shape(sink=64, local=192)")."""
    label, sep, spec = item.partition(": ")
    if sep and label and not any(c in label for c in " =()"):
        return label.strip(), spec.strip()
    return None, item


def expand_recipes(args) -> dict[str, object]:

    out = {}
    amounts = [("budget", str(args.budget))] if args.budget is not None else []
    ratios = _split(args.keep_ratio) if args.keep_ratio else [None]
    for item in _split(args.recipes):
        label, spec = _labelled(item)
        name = label or spec
        base = Recipe.parse(spec) if (" " in spec or "=" in spec) else preset(spec)
        if base.evict is None:
            out[name] = base
            continue
        # A recipe that names its own turn policy (the flowkv presets, "... turns=flowkv") keeps it;
        # --policies crosses only the others, which would otherwise be silently overridden.
        own_policy = "turns=" in spec or base.turns.name != Recipe().turns.name
        policies = [None] if own_policy else _split(args.policies)
        for ratio in ratios:
            for policy in policies:
                overrides = dict(amounts) | ({"keep_ratio": ratio} if ratio else {}) | ({"turns": policy} if policy else {})
                # The policy is in the label unless it is the only one and the default: a run under
                # flowkv alone must not resume from (or be mistaken for) a recompress run's records.
                named = policy and (len(policies) > 1 or policy != Recipe().turns.name)
                label = name + (f"@{policy}" if named else "") + (f"@{ratio}" if ratio else "")
                out[label] = base.with_overrides(overrides)
    out.pop("full", None)
    return out


def _machine(llm) -> str:
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else f"{cpu}, {os.cpu_count()} cores"
    return f"{where}; torch {torch.__version__}; {str(llm.dtype).removeprefix('torch.')}"


def cmd_quality(args) -> int:

    started = time.time()
    apply(args)
    if args.one_at_a_time and args.workers > 1:
        raise SystemExit("--one-at-a-time runs in one process; leave --workers out")
    engine = {"model": args.model, "dtype": args.dtype, "device": args.device, "kv_memory": args.kv_memory,
              "kv_dtype": getattr(args, "kv_dtype", None)}
    # With workers, this process only builds the instances and the report: a small KV pool.
    llm = LLM(**(engine | ({"kv_memory": "64MiB"} if args.workers > 1 and not args.report_only else {})))
    per_task = [generate(task, n=args.n, seed=args.seed, turns=args.turns, context_tokens=args.context_tokens,
                         difficulty=args.difficulty, tokenizer=llm.tokenizer) for task in _split(args.tasks)]
    # Instance i of every task before instance i+1 of any: a run stopped part-way covers every task.
    instances = [inst for group in itertools.zip_longest(*per_task) for inst in group if inst is not None]
    for item in args.data:
        fmt, _, path = item.partition(":")
        instances += load(fmt, path)
    config = QualityConfig(recipes=expand_recipes(args), positions=tuple(_split(args.positions)),
                           max_new_tokens=args.max_new_tokens, fidelity=not args.no_fidelity,
                           lockstep=not args.one_at_a_time, batch=args.batch, workers=args.workers, engine=engine)
    out = user_path(args.out)
    runs_path = out / "runs.json"  # every invocation that ran something: its wall time and machine
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else []
    if args.report_only:
        records = [r for rs in load_results(out / "results.jsonl").values() for r in rs]
    else:
        before = len(load_results(out / "results.jsonl"))
        records = run_quality(llm, instances, config, out / "results.jsonl")
        ran = len({(r["instance"], r["recipe"]) for r in records}) - before
        if ran:
            runs.append({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                         "wall_s": round(time.time() - started, 1), "conversations": ran, "workers": args.workers,
                         "batch": args.batch, "lockstep": not args.one_at_a_time, "machine": _machine(llm)})
            runs_path.write_text(json.dumps(runs, indent=1) + "\n")
    header = {"model": llm.name, "command": "turnkv bench quality " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
              "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "recipes": {name: str(r) for name, r in config.recipes.items()}, "runs": runs}
    write_report(records, out, header)
    print((out / "report.md").read_text())
    return 0
