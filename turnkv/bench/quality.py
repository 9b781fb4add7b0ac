"""`turnkv bench quality`: multi-turn conversations through each recipe, every turn scored, with
fidelity to the full-cache run of the same model.

Per instance, question position and recipe: a free run (the model's own answers in the history), each
reply scored, and with fidelity on a run teacher-forced along the full-cache answers, measuring how far
the next-token distributions drift. Runs in lockstep (turnkv/bench/lockstep.py) unless lockstep=False.
Results: a JSONL file, one line per turn, resumed on rerun; deterministic for given recipes, workers and
batch size. Design: docs/architecture.md#the-quality-runner"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from turnkv.bench.datasets.schema import Instance
from turnkv.bench.lockstep import PATTERN_FIGURES, SharedPrompt, Track, _pattern_figures, run_tracks
from turnkv.bench.metrics import first_divergence, greedy_agreement, mean_kl
from turnkv.bench.scoring import score_turn
from turnkv.engine.llm import LLM
from turnkv.methods.recipe import Recipe
from turnkv.paths import user_path

FULL = "full"


@dataclass
class QualityConfig:
    recipes: dict[str, object]  # display name -> recipe (string or Recipe); "full" is added when missing
    positions: tuple[str, ...] = ("begin", "middle", "end")
    max_new_tokens: int = 48
    fidelity: bool = True
    lockstep: bool = True  # batch the conversations of an instance (False: one at a time, the engine's path)
    batch: int = 16  # lockstep: recipes run together (each a free and maybe a forced conversation)
    max_batch: int = 32  # lockstep: rows of one decode forward
    workers: int = 1  # processes (lockstep only); each builds its engine from `engine`
    engine: dict | None = None  # LLM(**engine) in each worker


def run_quality(llm, instances: list[Instance], config: QualityConfig, results_path: str | Path,
                progress: bool = True) -> list[dict]:
    """Run every (instance, position, recipe), appending one record per turn to results_path."""
    results_path = user_path(results_path)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_results(results_path)
    recipes = {FULL: "full", **config.recipes}
    if not config.lockstep:
        _run_one_at_a_time(llm, instances, config, recipes, results_path, done, progress)
    else:
        placed = [inst.with_position(p) for inst in instances for p in config.positions]
        jobs = [(inst, name) for inst in placed for name in recipes if (inst.id, name) not in done]
        with results_path.open("a") as out, tqdm(total=len(jobs), desc="quality", unit="conv",
                                                 disable=not progress) as bar:
            def write(records):
                for record in records:
                    out.write(json.dumps(record) + "\n")
                out.flush()
                for record in records:
                    done.setdefault((record["instance"], record["recipe"]), []).append(record)
                bar.update(len({(r["instance"], r["recipe"]) for r in records}))

            if config.workers > 1:
                _run_workers(jobs, recipes, config, write)
            else:
                run_jobs(llm, jobs, recipes, config, write)
    return [r for records in done.values() for r in records]


# ---- lockstep -------------------------------------------------------------------------------------
def run_jobs(llm, jobs: list[tuple[Instance, str]], recipes: dict, config: QualityConfig, write) -> None:
    """Run (instance with its position, recipe name) jobs in lockstep; `write(records)` gets each
    finished chunk's records. The full-cache references of every instance come first (together), then
    the recipes in chunks of config.batch."""
    if not jobs:
        return
    shared = SharedPrompt(llm)
    instances = list({inst.id: inst for inst, _ in jobs}.values())
    turns = {inst.id: [turn.message() for turn in inst.turns] for inst in instances}
    wanted = {(inst.id, name) for inst, name in jobs}
    # Chunks whose conversations fit the KV pool: each recipe holds a free and a forced conversation.
    fits = _conversations_that_fit(llm, instances, config.max_new_tokens)
    batch = max(1, min(config.batch, fits // 2))
    # The references first, in chunks that hold about what a chunk of recipes holds.
    reference: dict[str, list[dict]] = {}
    for start in range(0, len(instances), 2 * batch):
        part = instances[start : start + 2 * batch]
        tracks = [Track(llm, inst.system, recipes[FULL], turns[inst.id], config.max_new_tokens, keep_logprobs=True,
                        shared=shared) for inst in part]
        _run(llm, tracks, part, config)
        for inst, track in zip(part, tracks):
            reference[inst.id] = track.outputs
            track.close()
        records = [r for inst in part if (inst.id, FULL) in wanted
                   for r in _records(llm, inst, FULL, recipes[FULL], reference[inst.id], reference[inst.id])]
        if records:
            write(records)
    for chunk in _chunks([job for job in jobs if job[1] != FULL], recipes, batch):
        tracks = []
        for inst, name in chunk:
            ref = [t["tokens"] for t in reference[inst.id]] if config.fidelity else None
            tracks.append(Track(llm, inst.system, recipes[name], turns[inst.id], config.max_new_tokens, reference=ref,
                                shared=shared, measure=_fidelity(reference[inst.id])))
        try:
            _run(llm, tracks, [inst for inst, _ in chunk], config)
            # The forced runs of recipes that diverged and cannot be forked, replayed together.
            replays = [(replay, inst) for track, (inst, _) in zip(tracks, chunk)
                       if (replay := track.replay()) is not None]
            try:
                _run(llm, [r for r, _ in replays], [inst for _, inst in replays], config)
            finally:
                for r, _ in replays:
                    r.close()
        finally:
            for track in tracks:
                track.close()
        write([r for (inst, name), track in zip(chunk, tracks)
               for r in _records(llm, inst, name, recipes[name], track.outputs, reference[inst.id])])


def _chunks(work: list[tuple[Instance, str]], recipes: dict, batch: int) -> list[list[tuple[Instance, str]]]:
    """The recipe jobs cut into chunks that run together: jobs whose decode steps are of one kind
    (plain, H2O's accumulation, decode selection) together, since each kind is its own forward per
    step and a forward costs about as much for 1 row as for 4, and each kind's jobs cut into as few chunks of at most `batch` as possible, of
    about equal sizes (a chunk of 2 rows after two of 16 would pay the small-batch price alone).
    Within a kind, recipes that keep about as much KV go together: a batched decode step gathers
    every row's keys padded to the longest row's."""
    kinds: dict[tuple, list] = {}
    for job in work:  # in the jobs' order (instance-major) within a kind
        kinds.setdefault(_step_kind(recipes[job[1]]), []).append(job)
    out = []
    for kind in sorted(kinds):
        jobs = sorted(kinds[kind], key=lambda job: _kv_share(recipes[job[1]]))  # stable: instance order kept
        n = -(-len(jobs) // batch)
        cuts = [round(i * len(jobs) / n) for i in range(n + 1)]
        out += [jobs[a:b] for a, b in zip(cuts, cuts[1:])]
    return out


def _kv_share(recipe) -> float:
    """About what share of the history the recipe keeps: its keep_ratio, 1 when it does not evict."""

    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(str(recipe))
    if r.evict is None:
        return 1.0
    return r.evict.keep_ratio if r.evict.keep_ratio is not None else 0.0


def _step_kind(recipe) -> tuple[bool, bool]:

    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(str(recipe))
    return r.accumulates_attention, r.selects_decode


def _conversations_that_fit(llm, instances, max_new_tokens: int) -> int:
    """How many conversations of the longest instance the KV pool holds with nothing evicted, with a
    margin for page rounding and the shared first prompt."""
    tokenizer = llm.tokenizer
    longest = max(sum(len(tokenizer.encode(t.message())) + 16 + max_new_tokens for t in inst.turns)
                  + len(tokenizer.encode(inst.system or "")) for inst in instances)
    per_conversation = (longest + 2 * llm.pool.page_size) * llm.kv_bytes_per_token()
    return max(1, int(0.85 * llm.pool.capacity_bytes() / per_conversation) - 1)


def _run(llm, tracks, instances, config) -> None:
    if not tracks:
        return
    turns = {len(inst.turns) for inst in instances}
    if len(turns) != 1:  # lockstep moves turn by turn: instances of a chunk have as many turns
        for track, inst in zip(tracks, instances):
            run_tracks(llm, [track], len(inst.turns), config.max_batch)
        return
    run_tracks(llm, tracks, turns.pop(), config.max_batch)


def _fidelity(full: list[dict]):
    """measure(turn, forced log-probs) -> agreement and KL against the full run's turn."""
    return lambda i, forced: {"agreement": greedy_agreement(forced, full[i]["tokens"]),
                              "kl": mean_kl(full[i]["logprobs"], forced)}


def _records(llm, inst: Instance, name: str, recipe, free: list[dict], full: list[dict]) -> list[dict]:
    records = []
    spec = str(llm.resolve_recipe(recipe))
    for i, (turn, run) in enumerate(zip(inst.turns, free)):
        record = {
            "instance": inst.id, "task": inst.task, "position": turn.position, "recipe": name,
            "recipe_spec": spec, "turn": i, "depends_on": turn.depends_on,
            "response": run["text"], "tokens": run["tokens"],
            "score": score_turn(turn, run["text"]) if turn.scored else None,
            "kv_bytes": run["kv_bytes"], "full_kv_bytes": full[i]["kv_bytes"], "history_tokens": run["history_tokens"],
            "first_divergence": first_divergence(run["tokens"], full[i]["tokens"]),
            "ttft_s": run["ttft_s"], "prefilled_tokens": run["prefilled_tokens"],
            **{k: run[k] for k in PATTERN_FIGURES if k in run},
        }
        if name == FULL:
            record.update(agreement=1.0, kl=0.0)
        elif run.get("forced") is not None:
            record.update(_fidelity(full)(i, run["forced"]))
        elif "agreement" in run:
            record.update(agreement=run["agreement"], kl=run["kl"])
        records.append(record)
    return records


# ---- workers --------------------------------------------------------------------------------------
def _cost(recipe) -> float:
    """Roughly what one recipe's conversation costs in lockstep, relative to an evicting recipe's (for
    splitting work): selecting decode steps cost about twice a plain one, and recipes that do not
    evict mostly reproduce the full cache's answers, so need no forced run."""

    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(str(recipe))
    if r.selects_decode:
        return 1.8
    if r.evict is None:
        return 0.5 if r.prefill.name == "dense" else 0.8  # the full cache: the reference run
    return 1.1 if r.accumulates_attention else 1.0


def _split_jobs(jobs, recipes, workers: int) -> list[list]:
    """`jobs` (instance-major) cut into `workers` consecutive parts of about equal cost: each worker
    runs the references of its instances only, so only the instances on a cut run theirs twice."""
    costs = [_cost(recipes[name]) for _, name in jobs]
    total, parts, acc = sum(costs), [[] for _ in range(workers)], 0.0
    for job, cost in zip(jobs, costs):
        k = min(workers - 1, int(acc / total * workers)) if total else 0
        parts[k].append(job)
        acc += cost
    return parts


def _run_workers(jobs, recipes, config: QualityConfig, write) -> None:
    import multiprocessing as mp
    import queue as queue_module

    shares = _split_jobs(jobs, recipes, config.workers)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    config = replace(config, recipes={})
    threads = max(1, (os.cpu_count() or 1) // config.workers)
    # Recipes travel as their strings (some hold per-conversation caches that do not pickle); a
    # recipe's string parses back to an equal recipe.
    specs = {name: str(r) if not isinstance(r, str) else r for name, r in recipes.items()}
    procs = [ctx.Process(target=_worker, args=(k, share, specs, config, threads, queue), daemon=True)
             for k, share in enumerate(shares) if share]
    for p in procs:
        p.start()
    running, error = len(procs), None
    try:
        while running:
            try:
                kind, payload = queue.get(timeout=10)
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = f"worker process {dead[0].pid} died (exit code {dead[0].exitcode})"
                    break
                continue
            if kind == "records":
                write(payload)
            elif kind == "done":
                running -= 1
            else:
                error = payload
                break
    finally:
        if error is not None:
            for p in procs:
                p.terminate()
        for p in procs:
            p.join()
    if error is not None:
        raise RuntimeError(f"a quality worker failed:\n{error}")


def _worker(index: int, jobs, recipes, config: QualityConfig, threads: int, queue) -> None:
    import traceback

    import torch

    try:
        torch.set_num_threads(threads)

        llm = LLM(**(config.engine or {}))
        run_jobs(llm, jobs, recipes, config, lambda records: queue.put(("records", records)))
        queue.put(("done", index))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


# ---- one conversation at a time (the engine's own path) -------------------------------------------
def _run_one_at_a_time(llm, instances, config, recipes, results_path, done, progress) -> None:
    jobs = [(inst.with_position(p), p, name) for inst in instances for p in config.positions for name in recipes]
    reference: dict = {}  # the full-cache run of the current instance: its tokens and log-probs
    with results_path.open("a") as out:
        for inst, position, name in tqdm(jobs, desc="quality", disable=not progress):
            if (inst.id, name) in done:
                continue
            if reference.get("id") != inst.id:
                # Greedy log-probs of the full run along its own answers are exactly what teacher
                # forcing the full cache on those answers gives: one run serves as the reference.
                reference = {"id": inst.id, "turns": _free_run(llm, inst, recipes[FULL], config, keep_logprobs=True)}
            full = reference["turns"]
            free = full if name == FULL else _free_run(llm, inst, recipes[name], config)
            if config.fidelity and name != FULL:
                for run, forced in zip(free, _forced_run(llm, inst, recipes[name], [r["tokens"] for r in full])):
                    run["forced"] = forced
            records = _records(llm, inst, name, recipes[name], free, full)
            for record in records:
                out.write(json.dumps(record) + "\n")
            out.flush()
            done[(inst.id, name)] = records


def _free_run(llm, inst: Instance, recipe, config, keep_logprobs: bool = False) -> list[dict]:
    conv = llm.conversation(system=inst.system, recipe=recipe)
    try:
        out = []
        for turn in inst.turns:
            seen = len(conv.method_stats)
            reply = conv.send(turn.message(), max_new_tokens=config.max_new_tokens, logprobs=keep_logprobs)
            out.append({"text": reply.text, "tokens": reply.token_ids, "kv_bytes": conv.kv_bytes,
                        "history_tokens": len(conv.tokens), "logprobs": reply.logprobs, "ttft_s": reply.ttft_s,
                        "prefilled_tokens": reply.prompt_tokens,  # the turn's new tokens only
                        **_pattern_figures(conv.method_stats[seen:])})
        return out
    finally:
        conv.close()


def _forced_run(llm, inst: Instance, recipe, answers: list[list[int]]) -> list:
    """The recipe fed the full run's answers: its log-probs along them, turn by turn."""
    conv = llm.conversation(system=inst.system, recipe=recipe)
    try:
        return [conv.send(turn.message(), force=answer, logprobs=True).logprobs
                for turn, answer in zip(inst.turns, answers)]
    finally:
        conv.close()


def load_results(path: Path) -> dict[tuple[str, str], list[dict]]:
    done: dict[tuple[str, str], list[dict]] = {}
    if not path.exists():
        return done
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            done.setdefault((record["instance"], record["recipe"]), []).append(record)
    return done
