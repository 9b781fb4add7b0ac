"""The synthetic task generators: answers reachable from the turns they depend on, question positions,
determinism, and the length, turn and difficulty knobs."""

from __future__ import annotations

import json
import re

import pytest

from turnkv.bench.datasets import fewshot, preferences
from turnkv.bench.datasets.filler import clean_paragraphs, corpus, count_tokens
from turnkv.bench.datasets.instructions import CONFLICTS, KINDS
from turnkv.bench.datasets.schema import METRICS, POSITIONS
from turnkv.bench.datasets.tasks import TASKS, generate
from turnkv.bench.instruction_checks import check
from turnkv.bench.scoring import score_turn

N = 6


@pytest.fixture(scope="module")
def made(smol_tokenizer):
    """Instances of every task at the defaults (3 turns) and longer ones, counted with SmolLM2's tokenizer."""
    out = {task: generate(task, N, seed=0, tokenizer=smol_tokenizer) + generate(task, 3, seed=1, turns=5,
                                                                               tokenizer=smol_tokenizer)
           for task in TASKS}
    out["preferences"] += [preferences.generate(1, seed=2, turns=4, tokenizer=smol_tokenizer, scenario=name)[0]
                           for name in preferences.SCENARIOS]
    return out


def has(text: str, answer: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(answer)}(?![\w-])", text) is not None


# -- hand-written responses for instruction sets ---------------------------------------------------

def satisfying(instructions: list[dict]) -> str:
    """A response that follows every instruction of a compatible set."""
    by = {i["kind"]: i for i in instructions}
    body = ["The passage explains how programs share data"]
    if "include" in by:
        body[0] += " with a " + " and a ".join(by["include"]["words"])
    body[0] += "."
    while len(body) < by.get("min_sentences", {}).get("n", 0):
        body.append("It reads well.")
    title = "<<notes on the passage>>" if "title" in by else None
    lines = [" ".join(x for x in (by.get("start", {}).get("phrase"), title, " ".join(body)) if x)]
    lines += ["* point number one"] * by.get("bullets", {}).get("n", 0)
    if "postscript" in by:
        lines.append("P.S. thanks for reading.")
    if "end" in by:
        lines.append(by["end"]["phrase"])
    text = "\n".join(lines)
    while "min_words" in by and len(re.findall(r"\w+", text)) < by["min_words"]["n"]:
        text = text.replace("share data", "share data well", 1)
    if "quotes" in by:
        text = f'"{text}"'
    if "json" in by:
        text = json.dumps({"answer": text})
    if "lowercase" in by:
        text = text.lower()
    if "uppercase" in by:
        text = text.upper()
    return text


def violating(instruction: dict, good: str) -> str:
    """A response that breaks `instruction`."""
    kind, n = instruction["kind"], instruction.get("n", 0)
    return {
        "lowercase": good.upper(), "uppercase": good.lower(), "min_words": "Too short.",
        "max_words": good + " word" * (n + 1), "min_sentences": "Just one sentence here.",
        "max_sentences": "Short one. " * (n + 1), "include": "Nothing relevant here.",
        "exclude": f"{good} {instruction.get('word')}", "start": "Oops " + good, "end": good + " Oops",
        "quotes": good.strip('"'), "no_commas": good + ", and more", "postscript": "A reply without a postscript.",
        "bullets": good + "\n* one more point", "json": "not json {", "title": "No title anywhere.",
    }[kind]


# -- every task ------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_structure_and_dependencies(made, task):
    for inst in made[task]:
        assert inst.task == task and inst.system and len(inst.turns) >= 3
        for t, turn in enumerate(inst.turns):
            assert turn.position == "end" and turn.metric in METRICS and turn.question
            assert all(isinstance(d, int) and 0 <= d < t for d in turn.depends_on)
            assert turn.depends_on == sorted(set(turn.depends_on))
            if turn.metric == "instructions":
                assert turn.answer == "" and turn.instructions
            else:
                assert turn.answer and not turn.instructions
    assert all(len(inst.turns) == 3 for inst in made[task][:N])  # the default turn count


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("task", ["needle_qa", "kv_retrieval"])
def test_retrieval_answers_sit_in_the_turn_they_depend_on(made, task, position):
    for inst in (i.with_position(position) for i in made[task]):
        for t, turn in enumerate(inst.turns):
            source = turn.depends_on[0] if turn.depends_on else t
            assert len(turn.depends_on) <= 1
            assert has(inst.turns[source].context, turn.answer)
            assert has(inst.turns[source].message(), turn.answer)  # a middle question never splits a record
            assert not any(has(other.context, turn.answer) for s, other in enumerate(inst.turns) if s != source)
            assert score_turn(turn, f"The answer is {turn.answer}.") == 1.0
            assert score_turn(turn, "I do not know.") == 0.0
        assert any(turn.depends_on for turn in inst.turns[1:])  # later turns reach back


def test_needle_distractors_share_the_kind_of_the_asked_fact(smol_tokenizer):
    for difficulty in (0, 2):
        inst = generate("needle_qa", 1, seed=3, turns=3, difficulty=difficulty, tokenizer=smol_tokenizer)[0]
        kinds = r"secret code of|harbour town of| hid the |crates of"
        planted = sum(len(re.findall(kinds, t.context)) for t in inst.turns)
        assert planted == 3 * (1 + difficulty)


def test_kv_styles(smol_tokenizer):
    lines = generate("kv_retrieval", 1, style="lines")[0]
    assert re.fullmatch(r"line [a-z]+-[a-z]+: REGISTER_CONTENT is <\d{5}>", lines.turns[0].context.split("\n")[0])
    assert "REGISTER_CONTENT" in lines.turns[0].question
    data = generate("kv_retrieval", 1, style="json")[0]
    pairs = {k: v for block in data.turns[0].context.split("\n\n") for k, v in json.loads(block).items()}
    key = re.search(r'"(.+)"', data.turns[0].question)[1]
    assert pairs[key] == data.turns[0].answer
    assert [i.id.split("-")[1] for i in generate("kv_retrieval", 2)] == ["lines", "json"]
    with pytest.raises(ValueError):
        generate("kv_retrieval", 1, style="yaml")


@pytest.mark.parametrize("position", POSITIONS)
def test_preferences_exactly_one_option_fits_the_stated_preference(made, position):
    seen = set()
    for inst in (i.with_position(position) for i in made["preferences"]):
        name = inst.id.split("-")[1]
        spec, query = preferences.SCENARIOS[name], inst.turns[-1]
        seen.add(name)
        (source,) = query.depends_on
        statement = inst.turns[source].question
        assert source < len(inst.turns) - 1
        for turn in inst.turns[:-1]:  # filler turns: a fact of their own document
            assert not turn.depends_on and has(turn.context, turn.answer)
        if isinstance(spec, preferences.Rule):
            assert query.metric == "instructions" and query.instructions
            good = satisfying(query.instructions)
            assert score_turn(query, good) == 1.0
            assert all(not check(i, violating(i, good)) for i in query.instructions)
            continue
        assert query.metric == "accuracy"
        options = re.findall(r"^([A-H])\. (.+)$", query.question, flags=re.MULTILINE)
        assert len(options) == 2 + 1  # difficulty 1
        fitting = [letter for letter, option in options if spec.fits(statement, option)]
        assert fitting == [query.answer]
        assert score_turn(query, query.answer) == 1.0
    assert seen == set(preferences.SCENARIOS)


def test_preferences_knobs(smol_tokenizer):
    inst = preferences.generate(1, turns=5, difficulty=3, scenario="vegetarian", pref_turn=2)[0]
    assert inst.turns[-1].depends_on == [2] and "vegetarian" in inst.turns[2].question
    assert len(re.findall(r"^[A-H]\. ", inst.turns[-1].question, flags=re.MULTILINE)) == 5
    budget = preferences.generate(1, difficulty=4, scenario="gift_budget")[0]
    assert len(re.findall(r"^[A-H]\. ", budget.turns[-1].question, flags=re.MULTILINE)) == 6
    system = preferences.generate(1, scenario="dog_name", pref_turn="system")[0]
    assert system.turns[-1].depends_on == [] and "dog's name is" in system.system
    with pytest.raises(ValueError):
        preferences.generate(1, turns=3, pref_turn=2)


@pytest.mark.parametrize("position", POSITIONS)
def test_instructions_accumulate_and_a_written_response_satisfies_them(made, position):
    for inst in (i.with_position(position) for i in made["instructions"]):
        previous: list[dict] = []
        for t, turn in enumerate(inst.turns):
            assert turn.depends_on == list(range(t))
            assert turn.instructions[: len(previous)] == previous and len(turn.instructions) == len(previous) + 1
            kinds = [i["kind"] for i in turn.instructions]
            assert len(set(kinds)) == len(kinds) and set(kinds) <= set(KINDS)
            assert not any(frozenset((a, b)) in CONFLICTS for a in kinds for b in kinds)
            good = satisfying(turn.instructions)
            assert all(check(i, good) for i in turn.instructions), (turn.instructions, good)
            assert score_turn(turn, good) == 1.0
            for i in turn.instructions:
                assert not check(i, violating(i, good)), (i, good)
            previous = turn.instructions


def test_instructions_difficulty_stacks_several_per_turn():
    inst = generate("instructions", 1, turns=3, difficulty=3)[0]
    assert [len(t.instructions) for t in inst.turns] == [3, 6, 9]
    many = generate("instructions", 1, turns=20)[0]  # more turns than compatible kinds: the set stops growing
    assert len(many.turns[-1].instructions) < 20
    assert all(check(i, satisfying(many.turns[-1].instructions)) for i in many.turns[-1].instructions)


@pytest.mark.parametrize("position", POSITIONS)
def test_fewshot_labels_follow_one_rule_and_are_shown(made, position):
    for inst in (i.with_position(position) for i in made["fewshot"]):
        named: dict[str, set[str]] = {}  # canonical type -> the names its examples carry
        shown = set()
        for t, turn in enumerate(inst.turns):
            assert turn.depends_on == list(range(t))
            for q, label in re.findall(r"Question: (.+)\nType: (\S+)", turn.context):
                canonical = next(c for c in fewshot.LABELS if q in fewshot.questions(c))
                named.setdefault(canonical, set()).add(label)
                shown.add(q)
            assert f"Type: {turn.answer}" in turn.context  # every type is shown in every turn
        assert all(len(names) == 1 for names in named.values())
        assert len({next(iter(n)) for n in named.values()}) == len(named)
        for turn in inst.turns:
            q = turn.question.split("Question: ")[-1]
            assert q not in shown  # a new question
            canonical = next(c for c in fewshot.LABELS if q in fewshot.questions(c))
            assert named[canonical] == {turn.answer}
            assert score_turn(turn, turn.answer) == 1.0


def test_fewshot_difficulty_sets_the_labels():
    def labels(d):
        inst = generate("fewshot", 1, seed=5, difficulty=d)[0]
        return {lab for t in inst.turns for lab in re.findall(r"Type: (\S+)", t.context)}

    assert len(labels(0)) == 2 and len(labels(1)) == 4 and labels(2) == set(fewshot.LABELS)
    assert len(labels(3)) == 6 and not labels(3) & set(fewshot.LABELS)


@pytest.mark.parametrize("task", TASKS)
def test_question_position_in_the_message(made, task):
    inst = made[task][0]
    for position in POSITIONS:
        for turn in inst.with_position(position).turns:
            message, q = turn.message(), turn.question
            assert turn.context and turn.context.count("\n\n") >= 1
            if position == "begin":
                assert message.startswith(q + "\n\n")
            elif position == "end":
                assert message.endswith("\n\n" + q)
            else:
                at = message.index("\n\n" + q + "\n\n")
                assert 0 < at and at + len(q) + 4 < len(message)
                assert message.replace("\n\n" + q, "", 1) == turn.context


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_instances_other_seed_others(task):
    a = generate(task, 3, seed=7)
    assert a == generate(task, 3, seed=7)
    assert a[:2] == generate(task, 2, seed=7)  # instance i does not depend on n
    b = generate(task, 3, seed=8)
    assert all(x.turns != y.turns for x, y in zip(a, b))
    assert len({i.id for i in a}) == 3 and a[0].with_position("begin").id != a[0].id


@pytest.mark.parametrize("context_tokens", [300, 1200])
@pytest.mark.parametrize("task", TASKS)
def test_context_length_follows_the_knob(smol_tokenizer, task, context_tokens):
    for inst in generate(task, 2, seed=0, turns=4, context_tokens=context_tokens, tokenizer=smol_tokenizer):
        assert len(inst.turns) == 4
        for turn in inst.turns:
            n = count_tokens(turn.context, smol_tokenizer)
            assert 0.75 * context_tokens <= n <= 1.25 * context_tokens, (task, n)


def test_lengths_without_a_tokenizer_use_the_word_estimate():
    inst = generate("needle_qa", 1, context_tokens=400)[0]
    for turn in inst.turns:
        assert 300 <= len(turn.context.split()) / 0.75 <= 500


def test_registry_rejects_unknown_tasks_and_bad_knobs():
    with pytest.raises(ValueError):
        generate("nope", 1)
    with pytest.raises(ValueError):
        generate("needle_qa", 1, turns=0)


def test_filler_is_prose_from_docstrings():
    paragraphs = corpus()
    assert len(paragraphs) > 1000 and corpus() is paragraphs
    assert sum(len(p.split()) for p in paragraphs) > 30_000
    for p in paragraphs:
        assert not re.search(r"\d|>>>|`|_|[{}\[\]<>=]", p) and p[0].isupper() and p.endswith(".")
    doc = ("Return the sum of the values.\n\n>>> add(1, 2)\n3\n\nThe result keeps the type of the first argument, "
           "so adding two integers gives an integer and adding two floats gives a float.\n\n"
           "Parameters\n----------\nx : int\n    The first value.")
    assert clean_paragraphs(doc) == ["The result keeps the type of the first argument, so adding two integers gives "
                                     "an integer and adding two floats gives a float."]
    assert count_tokens("") == 0 and count_tokens("one two three") == 4
