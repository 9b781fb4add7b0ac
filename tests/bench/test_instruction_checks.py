"""Every instruction family on responses that follow it and responses that break it."""

from __future__ import annotations

import pytest

from turnkv.bench.instruction_checks import CHECKS, check, count_sentences, count_words

CASES = [  # (instruction, passing responses, failing responses)
    ({"kind": "lowercase"}, ["all quiet on the river.", "p.s. no capitals here"], ["All quiet.", "quiet RIVER"]),
    ({"kind": "uppercase"}, ["ALL QUIET ON THE RIVER.", "P.S. LOUD"], ["ALL QUIET on the river.", "Loud"]),
    ({"kind": "min_words", "n": 5}, ["one two three four five", "It's a long, long way."],
     ["one two three four", "Hi!"]),
    ({"kind": "max_words", "n": 5}, ["one two three four five", "Short."], ["one two three four five six"]),
    ({"kind": "min_sentences", "n": 3}, ["One. Two! Three?", "First line\nSecond line\nThird line"],
     ["One. Two.", "Only one sentence here."]),
    ({"kind": "max_sentences", "n": 2}, ["One. Two.", "Just one."], ["One. Two. Three.", "a\nb\nc"]),
    ({"kind": "include", "words": ["garden", "river"]}, ["The Garden by the river.", "river, then garden"],
     ["Only the garden.", "Nothing at all."]),
    ({"kind": "exclude", "word": "very"}, ["It is every bit as good.", "Quite good."],
     ["It is very good.", "VERY good", "Very."]),
    ({"kind": "end", "phrase": "Any other questions?"}, ["Done. Any other questions?", '"Done. any other questions?"'],
     ["Any other questions? Bye.", "Done."]),
    ({"kind": "start", "phrase": "In short"}, ["In short, yes.", '"in short it works."'],
     ["Well, in short, yes.", "Shortly."]),
    ({"kind": "quotes"}, ['"Wrapped."', '  "Wrapped with spaces."  '], ["Not wrapped.", '"Half wrapped.', '"']),
    ({"kind": "no_commas"}, ["No commas here.", "Lists use and and or."], ["One, two.", "Trailing,"]),
    ({"kind": "postscript"}, ["Body.\nP.S. See you.", "Body. p. s. later"], ["Body only.", "Body.\nPS see you."]),
    ({"kind": "postscript", "marker": "P.P.S"}, ["Body.\nP.P.S. Later."], ["Body.\nP.S. Later."]),
    ({"kind": "bullets", "n": 2}, ["Intro:\n* one\n* two", "- one\n- two"],
     ["* one", "* one\n* two\n* three", "**bold** only\n* one"]),
    ({"kind": "json"}, ['{"answer": "yes"}', '```json\n{"a": [1, 2]}\n```', "[1, 2]"],
     ["{'answer': 'yes'}", "Here is JSON: {}", '{"a": 1'] ),
    ({"kind": "title"}, ["<<Poem of Joy>>\nText.", "Text with <<a title>> inside."],
     ["<<>>\nText.", "<Single> brackets.", "<<broken\ntitle>>"]),
]


def test_every_family_is_covered():
    assert {case[0]["kind"] for case in CASES} == set(CHECKS)


@pytest.mark.parametrize("instruction,good,bad", CASES, ids=[c[0]["kind"] for c in CASES])
def test_passing_and_failing_responses(instruction, good, bad):
    for response in good:
        assert check(instruction, response), response
    for response in bad:
        assert not check(instruction, response), response
    assert not check(instruction, "") and not check(instruction, "  \n ")  # a blank reply follows nothing


def test_counters():
    assert count_words("It's a long, long way.") == 6  # "It", "s", "a", "long", "long", "way"
    assert count_sentences("One. Two!  Three?\nFour") == 4 and count_sentences("") == 0
    assert count_sentences("Version 3.11 is out.") == 1


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError):
        check({"kind": "haiku"}, "An old silent pond.")


IFEVAL_CASES = [  # IFEval ids with IFEval's arguments, as Multi-IF files hold them
    ({"kind": "change_case:english_lowercase"}, "all lower", "Not lower"),
    ({"kind": "change_case:english_capital"}, "ALL CAPS", "Not caps"),
    ({"kind": "length_constraints:number_words", "relation": "less than", "num_words": 3}, "two words",
     "three words here"),
    ({"kind": "length_constraints:number_words", "relation": "at least", "num_words": 3}, "three words here", "two"),
    ({"kind": "length_constraints:number_sentences", "relation": "less than", "num_sentences": 2}, "One.", "One. Two."),
    ({"kind": "length_constraints:number_sentences", "relation": "at least", "num_sentences": 2}, "One. Two.", "One."),
    ({"kind": "keywords:existence", "keywords": ["river", "lamp"]}, "A lamp by the river.", "A lamp."),
    ({"kind": "keywords:forbidden_words", "forbidden_words": ["very", "nice"]}, "Good.", "Nice one."),
    ({"kind": "startend:end_checker", "end_phrase": "Is there anything else?"}, "Done. Is there anything else?",
     "Is there anything else? Done."),
    ({"kind": "startend:quotation"}, '"Quoted."', "Not quoted."),
    ({"kind": "punctuation:no_comma"}, "No commas.", "Yes, commas."),
    ({"kind": "detectable_content:postscript", "postscript_marker": "P.P.S"}, "Body.\nP.P.S. more", "Body."),
    ({"kind": "detectable_format:number_bullet_lists", "num_bullets": 2}, "* a\n* b", "* a"),
    ({"kind": "detectable_format:json_format"}, '{"a": 1}', "a: 1"),
    ({"kind": "detectable_format:title"}, "<<Title>> text", "Title text"),
]


@pytest.mark.parametrize("instruction,good,bad", IFEVAL_CASES,
                         ids=[f"{c[0]['kind']}-{c[0].get('relation', '')}" for c in IFEVAL_CASES])
def test_ifeval_ids_use_the_same_rules(instruction, good, bad):
    assert check(instruction, good) and not check(instruction, bad)


def test_ifeval_families_not_implemented_and_missing_arguments_are_errors():
    with pytest.raises(ValueError, match="unknown instruction kind"):
        check({"kind": "detectable_format:number_highlighted_sections", "num_highlights": 2}, "*a* *b*")
    with pytest.raises(ValueError, match="lacks its argument"):
        check({"kind": "length_constraints:number_words", "relation": "at least"}, "words")
