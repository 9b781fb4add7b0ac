"""Loaders for the public benchmark formats, on small files written in each format."""

from __future__ import annotations

import csv
import json
import re

import pytest

from turnkv.bench.datasets.loaders import load
from turnkv.bench.datasets.loaders.longbench import load_longbench
from turnkv.bench.datasets.loaders.loopserve import load_loopserve
from turnkv.bench.datasets.loaders.multi_if import load_multi_if
from turnkv.bench.datasets.loaders.prefeval import load_prefeval
from turnkv.bench.datasets.loaders.reading import DatasetError, DatasetFileNotFoundError, is_scored, read_records
from turnkv.bench.datasets.loaders.scbench import load_scbench
from turnkv.errors import InvalidRequestError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_json(path, value):
    path.write_text(json.dumps(value, indent=4), encoding="utf-8")
    return path


def options_in(question: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z])\. (.*)$", question, flags=re.M))


# ---------------------------------------------------------------------------------------------
# LongBench

LONGBENCH = [
    {"input": "Which magazine was started first, Arthur's Magazine or First for Women?",
     "context": "Passage 1:\nArthur's Magazine (1844-1846) was an American literary periodical.\n\n"
                "Passage 2:\nFirst for Women is a woman's magazine published by Bauer Media Group.",
     "answers": ["Arthur's Magazine"], "length": 27, "dataset": "hotpotqa", "language": "en",
     "all_classes": None, "_id": "6a2b0f4c"},
    {"input": "", "context": "The report reviews federal grant oversight.\n\nIt finds gaps in monitoring.",
     "answers": ["GAO found gaps in grant monitoring."], "length": 12, "dataset": "gov_report",
     "language": "en", "all_classes": None, "_id": "9c1d"},
    {"input": "Question: What is the capital of Peru?\nType:",
     "context": "Question: Who wrote Hamlet?\nType: Individual\nQuestion: How far is the Moon?\nType: Distance",
     "answers": ["City"], "length": 20, "dataset": "trec", "language": "en",
     "all_classes": ["Individual", "Distance", "City"], "_id": "t-1"},
]


def test_longbench_maps_every_field(tmp_path):
    qa, summary, trec = load_longbench(write_jsonl(tmp_path / "lb.jsonl", LONGBENCH))

    assert (qa.task, qa.id, len(qa.turns)) == ("hotpotqa", "6a2b0f4c", 1)
    t = qa.turns[0]
    assert t.context == LONGBENCH[0]["context"] and t.question == LONGBENCH[0]["input"]
    assert t.answer == ["Arthur's Magazine"] and t.position == "end" and t.metric == "f1"
    assert t.depends_on == [] and qa.system and "answer only" in qa.system
    assert t.message() == f"{t.context}\n\n{t.question}"  # input goes after the context

    # empty input: the question is the task's instruction; summaries are scored with Rouge-L
    assert summary.task == "gov_report" and summary.turns[0].metric == "rouge_l"
    assert summary.turns[0].question == "Write a one-page summary of the text above."
    assert summary.turns[0].answer == ["GAO found gaps in grant monitoring."]

    assert trec.task == "trec" and trec.turns[0].metric == "accuracy" and trec.turns[0].answer == ["City"]
    assert all(is_scored(i.turns[0]) for i in (qa, summary, trec))
    # the question can be moved: Begin puts it before the context
    assert qa.with_position("begin").turns[0].message().startswith(LONGBENCH[0]["input"])


def test_longbench_e_names_metric_overrides_and_missing_id(tmp_path):
    rec = dict(LONGBENCH[0], dataset="hotpotqa_e")
    rec.pop("_id")
    samsum = {"input": "Dialogue: A: hi\nSummary:", "context": "Dialogue: B: yo\nSummary: B greets.",
              "answers": ["A says hi."], "dataset": "samsum", "_id": "s1"}
    a, b = load_longbench(write_jsonl(tmp_path / "e.jsonl", [rec, samsum]), metrics={"samsum": "accuracy"})
    assert a.task == "hotpotqa" and a.id == "e-1" and a.turns[0].metric == "f1"
    assert b.turns[0].metric == "accuracy"
    assert load_longbench(tmp_path / "e.jsonl")[1].turns[0].metric == "rouge_l"


def test_longbench_errors_name_file_line_and_field(tmp_path):
    bad = dict(LONGBENCH[1])
    del bad["answers"]
    path = write_jsonl(tmp_path / "missing.jsonl", [LONGBENCH[0], bad])
    with pytest.raises(DatasetError, match=r"missing\.jsonl, line 2: .*'answers'") as e:
        load_longbench(path)
    assert (e.value.line, e.value.field) == (2, "answers")

    path = write_jsonl(tmp_path / "unknown.jsonl", [dict(LONGBENCH[0], dataset="mystery_qa")])
    with pytest.raises(DatasetError, match=r"unknown\.jsonl, line 1: unknown LongBench dataset 'mystery_qa'"):
        load_longbench(path)

    path = write_jsonl(tmp_path / "qa_no_input.jsonl", [dict(LONGBENCH[0], input="")])
    with pytest.raises(DatasetError, match=r"line 1: .*'input' is empty"):
        load_longbench(path)

    path = write_jsonl(tmp_path / "types.jsonl", [dict(LONGBENCH[0], answers=42.5), ])
    assert load_longbench(path)[0].turns[0].answer == "42.5"  # numbers are written out
    path = write_jsonl(tmp_path / "types2.jsonl", [dict(LONGBENCH[0], answers={"a": 1})])
    with pytest.raises(DatasetError, match=r"types2\.jsonl, line 1: field 'answers'"):
        load_longbench(path)


# ---------------------------------------------------------------------------------------------
# LoopServe

def loopserve_records():
    rendered = {
        "id": "nqa-0007", "dataset": "NQA",
        "turns": [
            {"prompts": {"begin": "Q1?\n\nStory A", "middle": "Story\n\nQ1?\n\nA", "end": "Story A\n\nQ1?"},
             "ground_truth": ["a lighthouse"], "dependent_turn_indices": [0]},
            {"prompts": {"begin": "Q2?\n\nStory B", "middle": "Story\n\nQ2?\n\nB", "end": "Story B\n\nQ2?"},
             "ground_truth": "her brother", "dependent_turn_indices": [1, 0]},
            {"prompts": {"begin": "Q3?\n\nStory C", "middle": "Story\n\nQ3?\n\nC", "end": "Story C\n\nQ3?"},
             "ground_truth": ["in winter", "winter"], "dependent_turn_indices": [2]},
        ],
    }
    as_list = [  # the listing's plain list of turns; the dataset comes from the file name
        {"context": "Paper one, part one.\n\nPaper one, part two.", "question": "What dataset is used?",
         "ground_truth": ["SQuAD"], "dependent_turn_indices": [0]},
        {"context": "Paper two.", "question": "How many layers?", "ground_truth": ["12"],
         "dependent_turn_indices": [0, 1]},
    ]
    return [rendered, as_list]


def test_loopserve_gives_one_instance_per_position(tmp_path):
    rendered, as_list = loopserve_records()
    out = load_loopserve(write_jsonl(tmp_path / "qasper.jsonl", [rendered, as_list]))
    assert [i.id for i in out] == ["nqa-0007-begin", "nqa-0007-middle", "nqa-0007-end",
                                   "qasper-2-begin", "qasper-2-middle", "qasper-2-end"]
    assert [i.task for i in out] == ["narrativeqa"] * 3 + ["qasper"] * 3
    for inst, pos in zip(out[:3], ("begin", "middle", "end")):
        assert len(inst.turns) == 3 and inst.system is None  # the prompts carry their own instructions
        for k, t in enumerate(inst.turns):
            assert t.position == pos and t.metric == "f1" and t.context == ""
            assert t.message() == rendered["turns"][k]["prompts"][pos]
        assert [t.depends_on for t in inst.turns] == [[], [0], []]  # only earlier turns
        assert [t.answer for t in inst.turns] == [["a lighthouse"], "her brother", ["in winter", "winter"]]
    begin, middle, end = out[3:]
    assert begin.system and len(begin.turns) == 2
    assert begin.turns[0].message().startswith("What dataset is used?")
    assert middle.turns[0].message() == "Paper one, part one.\n\nWhat dataset is used?\n\nPaper one, part two."
    assert end.turns[1].message() == "Paper two.\n\nHow many layers?"
    assert end.turns[1].depends_on == [0] and end.turns[1].answer == ["12"]

    only = load_loopserve(tmp_path / "qasper.jsonl", positions=["middle"])
    assert [i.id for i in only] == ["nqa-0007-middle", "qasper-2-middle"]


def test_loopserve_errors(tmp_path):
    rendered, _ = loopserve_records()
    bad = json.loads(json.dumps(rendered))
    del bad["turns"][1]["ground_truth"]
    path = write_jsonl(tmp_path / "ls.jsonl", [rendered, bad])
    with pytest.raises(DatasetError, match=r"ls\.jsonl, line 2: turn 1 .*'ground_truth'"):
        load_loopserve(path)

    bad = json.loads(json.dumps(rendered))
    del bad["turns"][2]["prompts"]["middle"]
    with pytest.raises(DatasetError, match=r"line 1: turn 2 .*'prompts.middle'"):
        load_loopserve(write_jsonl(tmp_path / "ls2.jsonl", [bad]))
    assert len(load_loopserve(tmp_path / "ls2.jsonl", positions=("begin", "end"))) == 2

    bad = json.loads(json.dumps(rendered))
    bad["turns"][0]["dependent_turn_indices"] = [2]
    with pytest.raises(DatasetError, match=r"line 1: .*turns \[2\] that do not come before it"):
        load_loopserve(write_jsonl(tmp_path / "ls3.jsonl", [bad]))

    with pytest.raises(DatasetError, match=r"notabench\.jsonl, line 1: unknown LongBench dataset 'notabench'"):
        load_loopserve(write_jsonl(tmp_path / "notabench.jsonl", [loopserve_records()[1]]))


# ---------------------------------------------------------------------------------------------
# Multi-IF (the published file is CSV whose list columns hold JSON text)

def multi_if_rows():
    def prompt(text):
        return json.dumps({"role": "user", "content": text})

    return [
        {"key": "1001:1:en", "language": "English",
         "turn_1_prompt": prompt("Write a poem about the sea. Do not use any commas."),
         "turn_1_instruction_id_list": json.dumps(["punctuation:no_comma"]),
         "turn_1_kwargs": json.dumps(["{}"]),
         "turn_2_prompt": prompt("Now highlight at least 2 sections with markdown."),
         "turn_2_instruction_id_list": json.dumps(["punctuation:no_comma",
                                                   "detectable_format:number_highlighted_sections"]),
         "turn_2_kwargs": json.dumps(["{}", json.dumps({"num_highlights": 2})]),
         "turn_3_prompt": prompt("Finally, answer in fewer than 80 words."),
         "turn_3_instruction_id_list": json.dumps(["punctuation:no_comma",
                                                   "detectable_format:number_highlighted_sections",
                                                   "length_constraints:number_words"]),
         "turn_3_kwargs": json.dumps(["{}", json.dumps({"num_highlights": 2}),
                                      json.dumps({"relation": "less than", "num_words": 80, "keyword": None})])},
        {"key": "1002:1:en", "language": "English",
         "turn_1_prompt": prompt("List three uses of copper, in all lowercase."),
         "turn_1_instruction_id_list": json.dumps(["change_case:english_lowercase"]),
         "turn_1_kwargs": json.dumps(["{}"]),
         "turn_2_prompt": prompt("End your answer with 'Is there anything else?'"),
         "turn_2_instruction_id_list": json.dumps(["change_case:english_lowercase", "startend:end_checker"]),
         "turn_2_kwargs": json.dumps(["{}", json.dumps({"end_phrase": "Is there anything else?"})]),
         "turn_3_prompt": "", "turn_3_instruction_id_list": "", "turn_3_kwargs": ""},
        {"key": "2001:1:zh", "language": "Chinese",
         "turn_1_prompt": prompt("用中文写一首关于海的诗。"),
         "turn_1_instruction_id_list": json.dumps(["punctuation:no_comma"]),
         "turn_1_kwargs": json.dumps(["{}"]),
         "turn_2_prompt": "", "turn_2_instruction_id_list": "", "turn_2_kwargs": "",
         "turn_3_prompt": "", "turn_3_instruction_id_list": "", "turn_3_kwargs": ""},
    ]


def check_multi_if(out):
    assert [i.id for i in out] == ["1001:1:en", "1002:1:en", "2001:1:zh"]
    poem, copper, chinese = out
    assert all(i.task == "multi_if" for i in out)
    assert [len(i.turns) for i in out] == [3, 2, 1]  # a conversation stops at its first empty prompt
    assert poem.turns[0].question == "Write a poem about the sea. Do not use any commas."
    assert chinese.turns[0].question == "用中文写一首关于海的诗。"
    assert [t.depends_on for t in poem.turns] == [[], [0], [0, 1]]
    for t in poem.turns + copper.turns:
        assert t.metric == "instructions" and t.answer == "" and t.context == "" and is_scored(t)
    assert poem.turns[0].instructions == [{"kind": "punctuation:no_comma"}]
    assert poem.turns[2].instructions == [
        {"kind": "punctuation:no_comma"},
        {"kind": "detectable_format:number_highlighted_sections", "num_highlights": 2},
        {"kind": "length_constraints:number_words", "relation": "less than", "num_words": 80},  # null dropped
    ]
    assert copper.turns[1].instructions[1] == {"kind": "startend:end_checker",
                                               "end_phrase": "Is there anything else?"}


def test_multi_if_from_jsonl_and_csv(tmp_path):
    rows = multi_if_rows()
    check_multi_if(load_multi_if(write_jsonl(tmp_path / "multi_if.jsonl", rows)))

    path = tmp_path / "multiIF_20241018.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    check_multi_if(load("Multi-IF", path))
    assert [i.id for i in load_multi_if(path, language="english")] == ["1001:1:en", "1002:1:en"]

    # already-decoded fields (a JSON export of the parsed data) load the same way
    decoded = [{k: (json.loads(v) if k.endswith(("_list", "_prompt")) and v else v) for k, v in r.items()}
               for r in rows]
    for r in decoded:
        for k in ("turn_1_kwargs", "turn_2_kwargs", "turn_3_kwargs"):
            r[k] = [json.loads(x) for x in json.loads(r[k])] if r[k] else r[k]
    check_multi_if(load_multi_if(write_jsonl(tmp_path / "decoded.jsonl", decoded)))


def test_multi_if_errors(tmp_path):
    rows = multi_if_rows()
    bad = dict(rows[0], turn_2_kwargs=json.dumps(["{}"]))
    with pytest.raises(DatasetError, match=r"mif\.jsonl, line 2: field 'turn_2_kwargs' has 1 entries for 2"):
        load_multi_if(write_jsonl(tmp_path / "mif.jsonl", [rows[1], bad]))

    bad = dict(rows[1])
    del bad["turn_1_prompt"]
    with pytest.raises(DatasetError, match=r"mif2\.jsonl, line 3: .*'turn_1_prompt'") as e:
        load_multi_if(write_jsonl(tmp_path / "mif2.jsonl", [rows[0], rows[2], bad]))
    assert e.value.field == "turn_1_prompt"

    bad = dict(rows[0], turn_2_prompt="")
    with pytest.raises(DatasetError, match=r"line 1: field 'turn_2_prompt' is empty but 'turn_3_prompt' is not"):
        load_multi_if(write_jsonl(tmp_path / "mif3.jsonl", [bad]))

    # CSV: the error names the row's line in the file
    path = tmp_path / "bad.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([rows[0], dict(rows[1], turn_1_instruction_id_list="not a list")])
    with pytest.raises(DatasetError, match=r"bad\.csv, line 3: field 'turn_1_instruction_id_list'"):
        load_multi_if(path)


# ---------------------------------------------------------------------------------------------
# PrefEval (per-topic JSON arrays)

PREF_MCQ = {
    "preference": "I have a severe peanut allergy, so I must avoid any foods containing peanuts.",
    "question": "I'm visiting Thailand next month. What Thai restaurants would you recommend for me?",
    "explanation": "Thai cuisine often uses peanuts; recommend places that can avoid them.",
    "classification_task_options": [
        "Baan Somtum, known for peanut-free Thai cooking.",
        "Thip Samai, famous for pad thai with crushed peanuts.",
        "Som Tam Nua, papaya salad with peanut dressing.",
        "Raan Jay Fai, crab omelettes with peanut sauce.",
    ],
}
PREF_EXPLICIT = {
    "preference": "I strongly dislike eating spicy food.",
    "question": "Can you suggest some must-try street food in Bangkok for me?",
    "explanation": "Bangkok street food is often spicy; the assistant should pick mild dishes.",
}


def test_prefeval_explicit_and_multiple_choice(tmp_path):
    path = write_json(tmp_path / "travel_restaurant.json", [PREF_MCQ, PREF_EXPLICIT])
    mcq, free = load_prefeval(path)

    assert (mcq.task, mcq.id, len(mcq.turns)) == ("prefeval_explicit", "travel_restaurant-0", 2)
    stated, asked = mcq.turns
    assert stated.question == PREF_MCQ["preference"] and stated.context == "" and not is_scored(stated)
    assert asked.question.startswith(PREF_MCQ["question"]) and asked.depends_on == [0]
    assert asked.metric == "accuracy" and is_scored(asked)
    shown = options_in(asked.question)
    assert sorted(shown.values()) == sorted(PREF_MCQ["classification_task_options"])
    assert shown[asked.answer] == PREF_MCQ["classification_task_options"][0]  # the preference-following one
    assert load_prefeval(path)[0].turns[1].question == asked.question  # the shuffle is seeded
    unshuffled = load_prefeval(path, shuffle=False)[0].turns[1]
    assert unshuffled.answer == "A"
    assert options_in(unshuffled.question)["A"] == PREF_MCQ["classification_task_options"][0]

    assert free.id == "travel_restaurant-1" and [t.question for t in free.turns] == [
        PREF_EXPLICIT["preference"], PREF_EXPLICIT["question"]]
    assert free.turns[1].answer == PREF_EXPLICIT["explanation"] and free.turns[1].metric == "rouge_l"


def test_prefeval_implicit_forms(tmp_path):
    choice = dict(PREF_EXPLICIT, implicit_query="What are good dinner options tonight?",
                  options=["A mild Italian bistro.", "A fiery Thai place."],
                  conversation={"query": "What are good dinner options tonight?",
                                "assistant_options": "1. A mild Italian bistro. 2. A fiery Thai place.",
                                "user_selection": "I'll take the bistro; the other is too spicy for me.",
                                "assistant_acknowledgment": "Good choice."},
                  aligned_op="A mild Italian bistro.", topic="travel_restaurant")
    persona = dict(PREF_MCQ, persona="A retired police officer",
                   conversation={"1": {"user": "I tend to avoid recipes with peanuts. Any cooking classes?",
                                       "assistant": "Try the community centre."},
                                 "0": {"user": "Any retirement hobbies?", "assistant": "Volunteering."}})
    a, b = load("prefeval", write_json(tmp_path / "implicit.json", [choice, persona]))

    assert (a.task, a.id) == ("prefeval_implicit_choice", "travel_restaurant-0")
    assert len(a.turns) == 2 and a.turns[0].context == choice["conversation"]["assistant_options"]
    assert a.turns[0].question == choice["conversation"]["user_selection"]
    assert choice["preference"] not in a.turns[0].message()  # the preference stays hidden
    assert a.turns[1].question == choice["question"] and a.turns[1].depends_on == [0]
    assert a.turns[1].metric == "rouge_l"  # its `options` belong to the earlier query, not to the question

    assert (b.task, b.id) == ("prefeval_implicit_persona", "implicit-1")
    assert [t.question for t in b.turns[:2]] == ["Any retirement hobbies?",
                                                  "I tend to avoid recipes with peanuts. Any cooking classes?"]
    assert not any(is_scored(t) for t in b.turns[:2])
    assert b.turns[2].depends_on == [0, 1] and b.turns[2].metric == "accuracy"


def test_prefeval_errors_give_the_line_a_record_starts_on(tmp_path):
    bad = dict(PREF_EXPLICIT)
    del bad["question"]
    path = write_json(tmp_path / "topic.json", [PREF_MCQ, bad])  # indent 4: record 2 starts on line 13
    with pytest.raises(DatasetError, match=r"topic\.json, line 13: .*'question'"):
        load_prefeval(path)

    bad = dict(PREF_EXPLICIT)
    del bad["preference"]
    with pytest.raises(DatasetError, match=r"line 2: .*'preference'"):
        load_prefeval(write_json(tmp_path / "nopref.json", [bad]))

    with pytest.raises(DatasetError, match=r"opts\.json, line 2: .*'classification_task_options'"):
        load_prefeval(write_json(tmp_path / "opts.json", [dict(PREF_MCQ, classification_task_options=["x"])]))


# ---------------------------------------------------------------------------------------------
# SCBench (scbench_<task>.jsonl)

def test_scbench_multi_turn_shared_context(tmp_path):
    kv = [{"id": 0, "context": json.dumps({"a1": "v1", "b2": "v2", "c3": "v3"}),
           "multi_turns": [{"input": "Key: \"a1\"\nThe value associated with the specified key is: ", "answer": "v1"},
                           {"input": "Key: \"b2\"\nThe value associated with the specified key is: ", "answer": "v2"},
                           {"input": "Key: \"c3\"\nThe value associated with the specified key is: ", "answer": "v3"}]},
          {"id": 1, "context": "{}", "multi_turns": [{"input": "Key: \"z\"", "answer": "none"}]}]
    first, second = load_scbench(write_jsonl(tmp_path / "scbench_kv.jsonl", kv))
    assert (first.task, first.id, len(first.turns), len(second.turns)) == ("scbench_kv", "0", 3, 1)
    assert first.system and "JSON" in first.system
    assert first.turns[0].context == kv[0]["context"] and [t.context for t in first.turns[1:]] == ["", ""]
    assert [t.question for t in first.turns] == [t["input"] for t in kv[0]["multi_turns"]]
    assert [t.answer for t in first.turns] == ["v1", "v2", "v3"]
    assert [t.depends_on for t in first.turns] == [[], [0], [0]]
    assert {t.metric for t in first.turns} == {"contains"} and {t.position for t in first.turns} == {"end"}


def test_scbench_choice_numbers_and_mixed_tasks(tmp_path):
    choice = [{"id": 7, "context": "A long novel.",
               "multi_turns": [{"input": "Who is the narrator?", "answer": "Nick",
                                "options": ["Gatsby", "Nick", "Daisy", "Tom"]},
                               {"input": "Where is West Egg?", "answer": "D",
                                "options": ["Paris", "Rome", "Oslo", "Long Island"]}]}]
    (c,) = load_scbench(write_jsonl(tmp_path / "scbench_choice_eng.jsonl", choice))
    assert c.task == "scbench_choice_eng" and [t.answer for t in c.turns] == ["B", "D"]
    assert options_in(c.turns[0].question) == {"A": "Gatsby", "B": "Nick", "C": "Daisy", "D": "Tom"}
    assert {t.metric for t in c.turns} == {"accuracy"}

    mf = [{"id": 3, "context": [4, 9, 1], "multi_turns": [{"input": "The largest number is", "answer": 9}]}]
    (m,) = load("scbench", write_jsonl(tmp_path / "multi_turn_mf.jsonl", mf))
    assert m.task == "scbench_mf" and m.turns[0].context == "[4, 9, 1]"
    assert m.turns[0].answer == "9" and m.turns[0].metric == "em"

    mixed = [{"id": 5, "context": "def f(): pass\n{\"k\": \"v\"}",
              "multi_turns": [{"input": "Repeat the function that does nothing.", "answer": "def f(): pass",
                               "task": "scbench_repoqa"},
                              {"input": "Key: \"k\"", "answer": "v", "task": "scbench_kv"}]}]
    (x,) = load_scbench(write_jsonl(tmp_path / "scbench_repoqa_and_kv.jsonl", mixed))
    assert [t.metric for t in x.turns] == ["rouge_l", "contains"]

    # a file name that names no task needs task=
    path = write_jsonl(tmp_path / "data.jsonl", choice)
    with pytest.raises(DatasetError, match=r"data\.jsonl, line 1: cannot tell the SCBench task"):
        load_scbench(path)
    assert load_scbench(path, task="scbench_choice_eng")[0].turns[0].answer == "B"


def test_scbench_errors(tmp_path):
    good = {"id": 0, "context": "ctx", "multi_turns": [{"input": "q", "answer": "a"}]}
    bad = {"id": 1, "context": "ctx", "multi_turns": [{"input": "q"}]}
    with pytest.raises(DatasetError, match=r"scbench_kv\.jsonl, line 2: multi_turns\[0\] .*'answer'"):
        load_scbench(write_jsonl(tmp_path / "scbench_kv.jsonl", [good, bad]))
    with pytest.raises(DatasetError, match=r"scbench_qa_eng\.jsonl, line 1: .*'multi_turns'"):
        load_scbench(write_jsonl(tmp_path / "scbench_qa_eng.jsonl", [{"id": 0, "context": "c"}]))
    bad = {"id": 2, "context": "c", "multi_turns": [{"input": "q", "answer": "Z", "options": ["x", "y"]}]}
    with pytest.raises(DatasetError, match=r"line 1: .*neither an option nor an option letter"):
        load_scbench(write_jsonl(tmp_path / "scbench_choice_eng.jsonl", [bad]))


# ---------------------------------------------------------------------------------------------
# Errors shared by every format, and the dispatcher

def test_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "longbench_hotpotqa.jsonl"
    for fmt in ("longbench", "loopserve", "multi_if", "prefeval", "scbench"):
        with pytest.raises(DatasetFileNotFoundError, match=r"no such file: .*longbench_hotpotqa\.jsonl") as e:
            load(fmt, path)
        assert isinstance(e.value, InvalidRequestError) and isinstance(e.value, FileNotFoundError)
    with pytest.raises(DatasetError, match="is a directory"):
        load_longbench(tmp_path)


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(LONGBENCH[0]) + "\n\n" + '{"input": "x", "context": \n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"broken\.jsonl, line 3: invalid JSON") as e:
        load_longbench(path)
    assert e.value.line == 3 and isinstance(e.value, ValueError)

    path = tmp_path / "broken_array.json"
    path.write_text('[\n  {"question": "q", "preference": "p"},\n  {"question": \n]\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"broken_array\.json, line 4: invalid JSON"):
        load_prefeval(path)

    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: file holds no records"):
        load_scbench(path, task="kv")


def test_unknown_format_and_dispatch(tmp_path):
    with pytest.raises(DatasetError, match=r"unknown dataset format 'ruler' \(known: longbench, loopserve"):
        load("ruler", tmp_path / "x.jsonl")
    path = write_jsonl(tmp_path / "lb.jsonl", LONGBENCH)
    assert [i.id for i in load("LongBench", path)] == ["6a2b0f4c", "9c1d", "t-1"]
    with pytest.raises(TypeError):
        load("longbench", path, language="en")  # options go to the loader, which checks them


def test_read_records_formats(tmp_path):
    # one pretty-printed record, a JSON array, and JSON lines all give (line, record) pairs
    write_json(tmp_path / "one.json", {"a": 1})
    assert read_records(tmp_path / "one.json") == [(1, {"a": 1})]
    write_json(tmp_path / "arr.json", [{"a": 1}, {"b": 2}])
    assert read_records(tmp_path / "arr.json") == [(2, {"a": 1}), (5, {"b": 2})]
    (tmp_path / "lines.jsonl").write_text('\n{"a": 1}\n\n{"b": 2}\n', encoding="utf-8")
    assert read_records(tmp_path / "lines.jsonl") == [(2, {"a": 1}), (4, {"b": 2})]
    # in a .jsonl file a line that is a list is a record (LoopServe's plain list of turns) ...
    (tmp_path / "lists.jsonl").write_text('[{"t": 1}]\n[{"t": 2}]\n', encoding="utf-8")
    assert read_records(tmp_path / "lists.jsonl") == [(1, [{"t": 1}]), (2, [{"t": 2}])]
    # ... unless the whole file is one pretty-printed array
    write_json(tmp_path / "arr.jsonl", [{"a": 1}, {"b": 2}])
    assert read_records(tmp_path / "arr.jsonl") == [(2, {"a": 1}), (5, {"b": 2})]
