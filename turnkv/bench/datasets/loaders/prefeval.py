"""PrefEval (amazon-science/PrefEval benchmark_dataset/*/<topic>.json: preference, question,
explanation; mcq_options adds classification_task_options, whose first entry is the one that
follows the preference; implicit forms add a `conversation` that reveals the preference)."""

from __future__ import annotations

import random
from pathlib import Path

from turnkv.bench.datasets.loaders.reading import Where, iter_records, multiple_choice
from turnkv.bench.datasets.schema import Instance, Turn


def _prefeval_history(rec: dict, where: Where) -> tuple[str, list[Turn]]:
    """The form and the unscored turns that carry the preference."""
    conv = rec.get("conversation")
    if conv is None:
        preference = where.need(rec, "preference", str)
        return "explicit", [Turn(context="", question=preference, answer="")]
    if isinstance(conv, dict) and "user_selection" in conv:
        selection = where.need(conv, "user_selection", str)
        options = conv.get("assistant_options") or ""
        if not isinstance(options, str):
            raise where.error("field 'conversation.assistant_options' must be text", "conversation.assistant_options")
        return "implicit_choice", [Turn(context=options, question=selection, answer="")]
    if isinstance(conv, dict):
        try:
            items = [conv[k] for k in sorted(conv, key=int)]
        except ValueError:
            raise where.error("field 'conversation' must be keyed by turn number or hold 'user_selection'",
                              "conversation") from None
    elif isinstance(conv, list):
        items = conv
    else:
        raise where.error("field 'conversation' must be an object or a list", "conversation")
    turns = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("user"), str):
            raise where.error(f"conversation turn {n} is missing required field 'user'", "conversation.user")
        turns.append(Turn(context="", question=item["user"], answer=""))
    if not turns:
        raise where.error("field 'conversation' is empty", "conversation")
    return "implicit_persona", turns


def load_prefeval(path: str | Path, shuffle: bool = True) -> list[Instance]:
    """PrefEval: per record, the turns that state or reveal the preference (unscored), then the
    question, which depends on them.

    - Explicit form: one turn that states `preference`.
    - Implicit choice form (`conversation` with `user_selection`): one turn whose context is the
      options the assistant offered and whose question is the user's choice.
    - Implicit persona form (`conversation` {"0": {"user", "assistant"}, ...}): one turn per user
      message. The dataset's assistant replies are dropped; the model answers with its own.
    The final question is multiple choice when `classification_task_options` is present: options are
    shuffled (seeded by the instance id, so runs agree) and the reference is the letter of the first
    (preference-following) option, metric "accuracy". Without options the reference is `explanation`
    with metric "rouge_l", only a proxy: PrefEval judges free answers with an LLM. Ids are
    "<topic>-<index in file>", the topic being `topic` or the file name."""
    stem = Path(path).stem
    out = []
    for where, rec in iter_records(path):
        if not isinstance(rec, dict):
            raise where.error(f"expected a JSON object, got {type(rec).__name__}")
        question = where.need(rec, "question", str)
        form, history = _prefeval_history(rec, where)
        topic = rec.get("topic") if isinstance(rec.get("topic"), str) else stem
        iid = f"{topic}-{where.index}"
        options = rec.get("classification_task_options")
        if options is not None:
            if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
                raise where.error("field 'classification_task_options' must list at least two options",
                                  "classification_task_options")
            rng = random.Random(f"prefeval:{iid}") if shuffle else None
            question, letter = multiple_choice(question, options, 0, rng)
            final = Turn(context="", question=question, answer=letter, metric="accuracy")
        else:
            explanation = where.need(rec, "explanation", str)
            final = Turn(context="", question=question, answer=explanation, metric="rouge_l")
        final.depends_on = list(range(len(history)))
        out.append(Instance(task=f"prefeval_{form}", id=iid, turns=[*history, final]))
    return out
