"""`turnkv bench speed`: latency and throughput against the hardware floor and against peers, in one run.

For each recipe, context and batch size it measures TTFT, time per output token, decode throughput,
peak device memory, and the prefill of later turns against kept history; each figure is set beside
its floor, computed from the copy bandwidth and matmul rate measured in the same run. Every timed
prefill has lengths no earlier call had (each repetition a token shorter): a conversation's lengths
do not repeat, so what a kernel library builds per shape (cuDNN's plans) is paid as users pay it.
    decode floor  = (weight bytes + KV bytes the step reads) / copy bandwidth
    prefill floor = max(matmul FLOPs / matmul rate, (weight bytes + KV bytes attended) / copy bandwidth)
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from turnkv.bench import hardware, peers
from turnkv.bench.floors import decode_kv_read_bytes
from turnkv.errors import InvalidRequestError, KVCacheFullError
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe
from turnkv.parallel.mirror import gather


@dataclass
class SpeedConfig:
    contexts: list[int]
    batches: list[int] = field(default_factory=lambda: [1])
    new_tokens: int = 64
    turns: int = 2  # later turns timed against kept history
    turn_tokens: int | tuple[int, ...] = 256  # new tokens of a later turn; several: each timed over the same history
    recipes: dict = field(default_factory=dict)  # label -> Recipe; {} means dense only
    peers: tuple[str, ...] = ("transformers", "sdpa")
    repeat: int = 3
    seed: int = 0
    skip_tokens: int = 16  # decode steps left out of the time per token (warm-up; LoopServe's is 16)

    def __post_init__(self):
        self.turn_tokens = (self.turn_tokens,) if isinstance(self.turn_tokens, int) else tuple(self.turn_tokens)


def _prompt(ctx: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 32000), (ctx,), generator=gen).tolist()


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def steady_time_per_token(reply, skip: int) -> float:
    """Seconds per decode step over the steps that made tokens skip .. n-1 (the first `skip` tokens
    left out: a decode selection's warm-up, graph captures), from the times the tokens were read;
    the whole decode when the reply is too short. With n - skip a multiple of a selection's period
    (LoopServe re-selects every 16 steps from step 16, LServe every 4), the span holds whole periods."""
    times = reply.token_times
    if not 1 <= skip < len(times):
        return reply.time_per_token_s
    return (times[-1] - times[skip - 1]) / (len(times) - skip)


def measure(llm, recipe, ctx: int, batch: int, cfg: SpeedConfig, hw: dict) -> dict:
    """`batch` prompts of `ctx` tokens through LLM.generate, the path users take: TTFT (batch 1),
    time per decode step after the first `cfg.skip_tokens` tokens, KV kept, peak memory."""
    prompts = [_prompt(ctx, llm.config.vocab_size, cfg.seed + b) for b in range(batch)]
    # Warm-up: two prefill slices (a later slice's kernels) and past the selection's first period, so no
    # kernel compile or graph capture lands in a timed run.
    warm = prompts[0][: min(ctx, llm.runner.prefill_chunk + 512)]
    recipe = recipe if tensor_parallel(llm) == 1 else str(recipe)  # it reaches the workers pickled
    llm.generate(warm, recipe=recipe, max_new_tokens=cfg.skip_tokens + 8, ignore_eos=True)
    runs = []
    _peak_reset(llm.device)
    for i in range(cfg.repeat if batch == 1 else 1):
        shorter = [p[: ctx - i] for p in prompts]  # a new length each time (the module's docstring)
        runs.append(llm.generate(shorter, recipe=recipe, max_new_tokens=cfg.new_tokens, ignore_eos=True))
    tpot = statistics.median(steady_time_per_token(replies[0], cfg.skip_tokens) for replies in runs)
    replies = runs[0]
    kv_bytes = sum(r.kv_bytes for r in replies)  # pages held at the end
    # What a last step reads (a quantized pool's scales included), or what its decode selection reads.
    element_size = llm.pool.token_bytes / (2 * llm.config.head_dim)
    kv_read = sum(decode_kv_read_bytes(Recipe.of(recipe), llm.config, element_size, ctx, r.kv_tokens * llm.pool.token_bytes)
                  for r in replies)
    decode_floor = hardware.decode_bytes(hw["weight_bytes"], kv_read) / hw["copy_bandwidth"]
    row = {"tpot_s": tpot, "tpot_floor_s": decode_floor, "tpot_of_floor": decode_floor / tpot,
           "tokens_per_s": batch / tpot, "kv_bytes": kv_bytes, "kv_read_bytes": kv_read,
           "tpot_whole_decode_s": statistics.median(r[0].time_per_token_s for r in runs),
           "peak_gb": _peak_gb(llm.device),
           "reply_tokens": replies[0].token_ids}  # the first prompt's greedy reply: the same under any split
    if batch == 1:
        ttft = statistics.median(r[0].ttft_s for r in runs)
        prefill_floor = hardware.prefill_floor(llm.config, hw, llm.kv_bytes_per_token(), ctx)
        row |= {"ttft_s": ttft, "ttft_floor_s": prefill_floor, "ttft_of_floor": prefill_floor / ttft}
    return row


@torch.inference_mode()
def measure_turns(llm, ctx: int, cfg: SpeedConfig, hw: dict) -> list[dict]:
    """Turn k+1's prefill against a kept history of ctx + k turns, one row per size in
    `cfg.turn_tokens` (each timed over the same history, then taken back); the history then grows by a
    turn of the first size. The last row also holds the time to re-prefill that whole history (what an
    engine without conversation state pays)."""
    seq = SequenceKV(llm.pool)
    held = _prompt(ctx, llm.config.vocab_size, cfg.seed)  # the token ids the sequence holds
    rows = []
    try:
        llm.runner.prefill(seq, held)
        for k in range(cfg.turns):
            history = seq.next_position
            for size in cfg.turn_tokens:
                new = _prompt(size, llm.config.vocab_size, cfg.seed + 100 + k)
                # After each call, off the clock, a rollback to a history a token shorter than the last
                # (a new length for every call: the module's docstring); then the history is put back.
                # Two untimed calls: Triton compiles a kernel once for lengths divisible by 16 and once
                # for the others.
                shorter = itertools.count(1)
                kept = hardware.median_time(lambda: llm.runner.prefill(seq, new), llm.device, repeat=cfg.repeat,
                                            warmup=2, after=lambda: seq.truncate(max(0, history - next(shorter))))
                llm.runner.prefill(seq, held[seq.next_position : history])
                floor = hardware.prefill_floor(llm.config, hw, llm.kv_bytes_per_token(), size, history)
                rows.append({"turn": k + 2, "history_tokens": history, "new_tokens": size, "prefill_s": kept,
                             "floor_s": floor})
            turn = _prompt(cfg.turn_tokens[0], llm.config.vocab_size, cfg.seed + 100 + k)
            llm.runner.prefill(seq, turn)
            held += turn
        whole = _prompt(seq.next_position, llm.config.vocab_size, cfg.seed)
        seq.free()  # the pool needs room for the history once, not twice
        fresh = SequenceKV(llm.pool)
        rows[-1]["reprefill_whole_history_s"] = hardware.median_time(
            lambda: llm.runner.prefill(fresh, whole), llm.device, repeat=max(1, cfg.repeat - 1),
            after=lambda: fresh.truncate(0))
        fresh.free()
    finally:
        seq.free()
    return rows


def pool_bytes(config, dtype, kv_dtype, tokens: int) -> int:
    """Bytes of a KV pool that holds `tokens` tokens of every layer and KV head in `kv_dtype` storage
    (None: the model's `dtype`), with a tenth and 64 MiB to spare (the pages' rounding, a warm-up's)."""
    per_token = config.num_layers * config.num_kv_heads * PagePool.token_head_bytes(config.head_dim, dtype, kv_dtype)
    return int(tokens * per_token * 1.1) + (64 << 20)


def measure_hardware(llm) -> dict:
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    return {"device": torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu",
            "copy_bandwidth": hardware.copy_bandwidth(llm.device),
            "matmul_rate": hardware.matmul_rate(llm.device, llm.dtype), "weight_bytes": weight_bytes}


def tensor_parallel(llm) -> int:
    """How many ranks the engine's model is split over (1: one device)."""
    return 1 if llm.parallel is None else llm.parallel.size


def devices(llm) -> list[str]:
    """The device of each rank, in rank order: cuda:r is rank r's GPU (its name), or "cpu"."""
    n = tensor_parallel(llm)
    if llm.device.type != "cuda":
        return [str(llm.device)] * n
    first = llm.device.index or 0
    return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(first, first + n)]


def _settings(llm, cfg: SpeedConfig) -> dict:
    """What every row's figures depend on besides its own recipe, context and batch size."""
    parallel = {"tensor_parallel": tensor_parallel(llm)} if tensor_parallel(llm) > 1 else {}
    return {"model": llm.name, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
            "kv_dtype": llm.pool.kv_dtype_name, **parallel,
            **{k: getattr(cfg, k) for k in ("new_tokens", "turns", "repeat", "seed", "skip_tokens")},
            "turn_tokens": list(cfg.turn_tokens)}  # a list, as the rows file's JSON reads it back


def _row_key(kind: str, spec: str, ctx: int, batch: int) -> str:
    return json.dumps([kind, spec, ctx, batch])


def _read_rows(path: Path, settings: dict) -> tuple[dict | None, dict[str, dict]]:
    """(hardware, rows by key) of an earlier run's rows file; (None, {}) when there is none.
    InvalidRequestError when it was made with other settings."""
    if not path.exists():
        return None, {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return None, {}
    head = lines[0]
    if head.get("settings") != settings:
        raise InvalidRequestError(
            f"{path} holds rows measured with other settings ({head.get('settings')}, now {settings}); "
            f"give another --out, or delete {path} to measure again")
    return head["hardware"], {line["key"]: line["row"] for line in lines[1:]}


def run_speed(llm, cfg: SpeedConfig, progress: bool = True, rows_path: str | Path | None = None) -> dict:
    """Measure every planned row (recipes x contexts x batches, later turns, peers); returns the run:
    hardware, settings and rows. rows_path: a JSONL file every finished row is appended to as it
    completes; the rows an earlier run with the same settings wrote there are kept, not measured
    again (a stopped run resumes), with that run's hardware figures."""
    recipes = cfg.recipes or {"full": Recipe()}
    settings = _settings(llm, cfg)
    hw, done = _read_rows(Path(rows_path), settings) if rows_path is not None else (None, {})
    if hw is None:
        hw = measure_hardware(llm)
        if rows_path is not None:
            Path(rows_path).parent.mkdir(parents=True, exist_ok=True)
            Path(rows_path).write_text(json.dumps({"settings": settings, "hardware": hw}) + "\n")
    spec = {name: str(recipe) for name, recipe in recipes.items()} | {"full": str(Recipe())}
    plan = [("turnkv", name, ctx, b) for name in recipes for ctx in cfg.contexts for b in cfg.batches]
    plan += [("turns", "full", ctx, 1) for ctx in cfg.contexts if cfg.turns > 0]
    plan += [(peer, "full", ctx, b) for peer in cfg.peers for ctx in cfg.contexts
             for b in (cfg.batches if peer == "transformers" else [1])]
    rows, hf_model = [], None
    for kind, name, ctx, batch in tqdm(plan, desc="bench speed", disable=not progress):
        key = _row_key(kind, spec[name], ctx, batch)
        if key in done:
            rows.append({**done[key], "recipe": name})
            continue
        row = {"engine": kind if kind != "turns" else "turnkv", "recipe": name, "context": ctx, "batch": batch}
        try:
            if kind == "turnkv":
                row |= measure(llm, recipes[name], ctx, batch, cfg, hw)
            elif kind == "turns":
                # Under tensor parallelism every rank runs the same prefills (turnkv.parallel.mirror.gather);
                # rank 0's times are kept.
                row["turns"] = gather(llm, measure_turns, ctx, replace(cfg, recipes={}), hw)[0]
            elif tensor_parallel(llm) > 1:
                raise peers.PeerUnavailable("the peers run on one device, not split over tensor-parallel ranks")
            elif kind == "sdpa":
                row["ttft_s"] = peers.sdpa_prefill(llm.config, ctx, llm.device, llm.dtype)
                row["note"] = "causal SDPA alone over all layers: the attention part of prefill"
            elif kind == "transformers":
                hf_model = hf_model or peers.transformers_model(llm)
                prompts = torch.tensor([_prompt(ctx, llm.config.vocab_size, cfg.seed + b) for b in range(batch)],
                                       device=llm.device)
                # Past 64K prompt tokens in the batch, transformers prefills in chunks of 2048 as it allows,
                # or its one-shot prefill's activations alone would exhaust the GPU.
                chunk = 2048 if batch * ctx > 65536 else None
                row |= peers.transformers_generate(hf_model, prompts, cfg.new_tokens, llm.device,
                                                   repeat=cfg.repeat, prefill_chunk=chunk)
        except peers.PeerUnavailable as e:
            row["unavailable"] = str(e)
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            row["unavailable"] = f"out of memory: {str(e).splitlines()[0]}"
        except KVCacheFullError as e:  # a shape past --kv-memory: the other rows still run
            row["unavailable"] = f"KV pool full: {e}"
        rows.append(row)
        if rows_path is not None:
            with open(rows_path, "a") as f:
                f.write(json.dumps({"key": key, "row": row}, default=str) + "\n")
    return {"hardware": hw, "model": llm.name, "dtype": str(llm.dtype).removeprefix("torch."),
            "kv_dtype": llm.pool.kv_dtype_name, "tensor_parallel": tensor_parallel(llm), "devices": devices(llm),
            "config": {k: v for k, v in vars(cfg).items() if k != "recipes"},
            "recipes": {name: str(r) for name, r in recipes.items()}, "rows": rows}
