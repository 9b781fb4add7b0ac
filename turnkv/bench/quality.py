"""`turnkv bench quality`: multi-turn conversations through each recipe, every turn scored, with
fidelity to the full-cache run of the same model.

For each instance, question position and recipe, the turns are fed in order with the model's own
answers in the history (a free run), and each reply is scored. With fidelity on, the recipe is run a
second time with the full-cache run's answers teacher-forced, to measure how far its next-token
distributions drift from the full cache's along the same answer.

Results go to a JSONL file, one line per turn; a rerun skips what that file already holds, so an
interrupted run resumes. Everything is deterministic under greedy decoding and the task seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from turnkv.bench.datasets.schema import Instance
from turnkv.bench.metrics import first_divergence, greedy_agreement, mean_kl
from turnkv.bench.scoring import score_turn

FULL = "full"


@dataclass
class QualityConfig:
    recipes: dict[str, object]  # display name -> recipe (string or Recipe); "full" is added when missing
    positions: tuple[str, ...] = ("begin", "middle", "end")
    max_new_tokens: int = 48
    fidelity: bool = True


def run_quality(llm, instances: list[Instance], config: QualityConfig, results_path: str | Path,
                progress: bool = True) -> list[dict]:
    """Run every (instance, position, recipe), appending one record per turn to results_path."""
    results_path = Path(results_path)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_results(results_path)
    recipes = {FULL: "full", **config.recipes}
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
            records = _evaluate(llm, inst, position, name, recipes[name], reference["turns"], config)
            for record in records:
                out.write(json.dumps(record) + "\n")
            out.flush()
            done[(inst.id, name)] = records
    return [r for records in done.values() for r in records]


def _evaluate(llm, inst: Instance, position: str, name: str, recipe, full: list[dict], config) -> list[dict]:
    free = full if name == FULL else _free_run(llm, inst, recipe, config)
    forced = None
    if config.fidelity and name != FULL:
        forced = _forced_run(llm, inst, recipe, [r["tokens"] for r in full])
    records = []
    for i, (turn, run) in enumerate(zip(inst.turns, free)):
        record = {
            "instance": inst.id, "task": inst.task, "position": position, "recipe": name,
            "recipe_spec": str(llm.resolve_recipe(recipe)), "turn": i, "depends_on": turn.depends_on,
            "response": run["text"], "tokens": run["tokens"], "score": score_turn(turn, run["text"]) if turn.scored else None,
            "kv_bytes": run["kv_bytes"], "full_kv_bytes": full[i]["kv_bytes"], "history_tokens": run["history_tokens"],
            "first_divergence": first_divergence(run["tokens"], full[i]["tokens"]),
            "ttft_s": run["ttft_s"], "prefilled_tokens": run["prefilled_tokens"],
            **{k: run[k] for k in PATTERN_FIGURES if k in run},
        }
        if forced is not None:
            record["agreement"] = greedy_agreement(forced[i], full[i]["tokens"])
            record["kl"] = mean_kl(full[i]["logprobs"], forced[i])
        elif name == FULL:
            record.update(agreement=1.0, kl=0.0)
        records.append(record)
    return records


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


PATTERN_FIGURES = ("density", "recovered_mass")  # what a sparse prefill computed, when the recipe has one


def _pattern_figures(stats: list[dict]) -> dict:
    """The turn's prefill density (computed / causal cells) and LoopServe's recovered mass."""
    prefill = [entry["prefill"] for entry in stats if "prefill" in entry]
    if not prefill:
        return {}
    return {k: prefill[-1][k] for k in PATTERN_FIGURES if k in prefill[-1]}


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
