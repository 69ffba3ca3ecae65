"""IFEval's instruction checks (featcal.zoo.score.ifeval): each supported id on a reply that
follows it and one that does not, the row formats, and the refusals before any generation."""

from __future__ import annotations

import pytest

from featcal.zoo.score.ifeval import (
    IFEVAL,
    check_ifeval_targets,
    count_sentences,
    count_words,
    ifeval,
    ifeval_followed,
    ifeval_supported,
)

# (instruction id, kwargs, a reply that follows it, one that does not)
CASES = [
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", "one two"),
    ("length_constraints:number_words", {"num_words": 3, "relation": "less than"}, "just two", "now three words"),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "at least"},
        "Hi. Pi is 3.14!",
        "Pi is 3.14.",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "First.\n***\nSecond.",
        "First.\n***\n***\nSecond.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        'First part.\n\n"Then, the rest.',
        "First part.\n\nAnd then the rest.",
    ),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Points:\n* one\n- two", "* one\n* two\n* three"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{'a': 1}"),
    ("detectable_format:title", {}, "<<A Poem>>\nRoses...", "<< >>\nRoses..."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and *two*", "*one* and **"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSection 2\nB",
        "Section 1\nA only",
    ),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "At [address] on [date].", "At [address]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Bye.\nP.S. see you", "Bye. PS see you"),
    ("change_case:english_lowercase", {}, "all lower case, 123.", "Not all lower"),
    ("change_case:english_capital", {}, "ALL CAPS, 123!", "ALL CAPS but one"),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "THE END IS near",
        "The END is near",
    ),
    ("keywords:existence", {"keywords": ["merge", "C++"]}, "We MERGE models in C++.", "We merge models in C."),
    ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "A category of dogs.", "The Cat sat."),
    ("keywords:frequency", {"keyword": "model", "frequency": 2, "relation": "at least"}, "model, Model", "a model"),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "a zebra",
        "Zig zag",
    ),
    ("punctuation:no_comma", {}, "No commas here.", "One, comma."),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        'Done. any other questions?"',
        "Any other questions? Yes.",
    ),
    ("startend:quotation", {}, ' "Quoted." ', '"Half quoted.'),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
    (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Write a poem."},
        "write a poem. Roses...",
        "Sure: Write a poem.",
    ),
]


@pytest.mark.parametrize("iid, kwargs, follows, breaks", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_instruction_tells_following_from_breaking(iid, kwargs, follows, breaks):
    target = [{"instruction_id": iid, "kwargs": kwargs}]
    assert ifeval(follows, target) == 1.0
    assert ifeval(breaks, target) == 0.0


def test_every_supported_instruction_is_tested():
    assert {c[0] for c in CASES} == set(IFEVAL)


def test_strict_accuracy_needs_every_instruction_and_reads_ifeval_rows():
    row = {  # a google/IFEval row: parallel lists, every key present, None where unused
        "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
        "kwargs": [{"num_words": None, "relation": None}, {"num_words": 3, "relation": "at least"}],
    }
    assert ifeval_followed("three short words", row) == [True, True]
    assert ifeval_followed("three, short words", row) == [False, True]
    assert ifeval("three, short words", row) == 0.0
    assert ifeval("three short words", row) == 1.0


def test_counts():
    assert count_words("Don't stop - it's 3.14") == 7  # \w+ runs, as IFEval counts: don, t, ..., 3, 14
    assert count_sentences("One. Two! Three? four") == 4
    assert count_sentences("Pi is 3.14 and e is 2.72.") == 1


@pytest.mark.parametrize(
    "target, message",
    [
        ([{"instruction_id": "language:response_language", "kwargs": {"language": "fr"}}], "not supported"),
        ([{"instruction_id": "no:such_thing", "kwargs": {}}], "keywords:existence"),  # the supported ones, listed
        (
            [{"instruction_id": "length_constraints:number_words", "kwargs": {"num_words": 3}}],
            "missing kwarg 'relation'",
        ),
        (
            [{"instruction_id": "length_constraints:number_words", "kwargs": {"num_words": 3, "relation": "at most"}}],
            "less than",
        ),
        ([{"instruction_id": "punctuation:no_comma", "kwargs": {"num_word": 3}}], "unknown kwarg 'num_word'"),
        ([{"instruction_id": "keywords:existence", "kwargs": {"keywords": "merge"}}], "list of words"),
        ([{"instruction_id": "detectable_format:number_bullet_lists", "kwargs": {"num_bullets": -1}}], ">= 0"),
        ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, "1 instruction ids but 2 kwargs"),
        ("punctuation:no_comma", "a list"),
    ],
)
def test_bad_targets_are_refused_before_generation(target, message):
    good = [{"instruction_id": "punctuation:no_comma", "kwargs": {}}]
    with pytest.raises(ValueError, match="IFEval example 1") as raised:
        check_ifeval_targets([good, target])
    assert message in str(raised.value)


def test_supported_rows_can_be_kept():
    rows = [
        {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
        {
            "instruction_id_list": ["punctuation:no_comma", "language:response_language"],
            "kwargs": [{}, {"language": "fr"}],
        },
    ]
    assert [ifeval_supported(r) for r in rows] == [True, False]
    check_ifeval_targets([r for r in rows if ifeval_supported(r)])
