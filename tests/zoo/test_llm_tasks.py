"""The LLM zoo's tasks: generators (seeded, disjoint splits) and metrics on hand-made answers."""

from __future__ import annotations

import pytest

from featcal.zoo.builtin import llm_tasks as lt
from featcal.zoo.builtin.text_data import WORDNET_DIR
from featcal.zoo.load.lm_dir import spec_doc
from featcal.zoo.score import scorers
from featcal.zoo.spec.parsing import from_dict

needs_wordnet = pytest.mark.skipif(
    not (WORDNET_DIR / "data.noun").is_file(), reason="needs WordNet: sudo apt-get install wordnet-base"
)
SIZES = {"train": 40, "calib": 10, "val": 10, "test": 200}


def _ex(**kw) -> lt.Example:
    return lt.Example(prompt="q", answer="a", **kw)


# ------------------------------------------------------------------ metrics on hand-made answers


def test_arithmetic_exact_match_of_the_final_number():
    ex = "17"  # the target (a scorer reads the reply and the example's target)
    assert lt.score_arithmetic("The answer is 17.", ex) == 1.0
    assert lt.score_arithmetic("7 * 3 = 21, minus 4 is 17", ex) == 1.0  # no "answer is": the last number
    assert lt.score_arithmetic("The answer is 17.0", ex) == 1.0
    assert lt.score_arithmetic("The answer is 18.", ex) == 0.0  # wrong
    assert lt.score_arithmetic("The answer is 17 or 18, then 3", ex) == 1.0  # the first number after it
    assert lt.score_arithmetic("Tom has 17 apples and 5 more, so", ex) == 0.0  # cut off: the last number is 5
    assert lt.score_arithmetic("seventeen", ex) == 0.0  # badly formatted: no number
    assert lt.score_arithmetic("", ex) == 0.0
    assert lt.score_arithmetic("The answer is 1,017.", "1017") == 1.0


def test_python_exact_match_of_the_first_line():
    ex = "-5"
    assert lt.score_python("-5", ex) == 1.0
    assert lt.score_python("  `-5`.\nbecause min(...)", ex) == 1.0
    assert lt.score_python("```\n-5\n```", ex) == 1.0
    assert lt.score_python("5", ex) == 0.0  # wrong
    assert lt.score_python("The expression evaluates to -5.", ex) == 0.0  # badly formatted
    assert lt.score_python("", ex) == 0.0


def test_choice_by_log_likelihood():
    ex = _ex(options=("trave", "gonif", "crupper", "cummerbund"), label=2)
    assert lt.score_choice([-3.0, -2.0, -0.5, -4.0], ex) == 1.0
    assert lt.score_choice([-0.1, -2.0, -0.5, -4.0], ex) == 0.0  # wrong
    assert lt.score_choice([-0.5, -2.0, -0.5, -4.0], ex) == 0.0  # a tie is not a pick
    assert lt.score_choice([float("nan"), -2.0, -0.5, -4.0], ex) == 0.0  # badly formatted
    assert lt.score_choice([-1.0, -0.5], ex) == 0.0  # too few options


@pytest.mark.parametrize(
    "constraint, right, wrong, bad",
    [
        ({"kind": "upper"}, "A LARGE CAT, 3 LEGS", "A large cat", "123 ..."),
        ({"kind": "words", "n": 4}, "a very large cat.", "a large cat", "a,large,cat,ok"),
        ({"kind": "end", "word": "done"}, "a large cat, done.", "a large cat", "done a large cat"),
        (
            {"kind": "json", "key": "answer"},
            '```json\n{"answer": "a cat"}\n```',
            '{"meaning": "a cat"}',
            "{answer: a cat}",
        ),
    ],
)
def test_instruction_constraints(constraint, right, wrong, bad):
    ex = lt.constraint_text(constraint)  # the target: the constraint as JSON text
    assert lt.score_instruction(right, ex) == 1.0
    assert lt.score_instruction(wrong, ex) == 0.0
    assert lt.score_instruction(bad, ex) == 0.0


def test_unknown_constraint_is_an_error():
    with pytest.raises(ValueError, match="unknown constraint kind"):
        lt.follows("x", {"kind": "rhyme"})
    with pytest.raises(ValueError, match="not a constraint"):
        lt.check_constraints([lt.constraint_text({"kind": "upper"}), '{"kind": "rhyme"}'])
    lt.check_constraints([lt.constraint_text({"kind": "words", "n": 3})])


# ------------------------------------------------------------------ generators


def test_python_answers_are_what_python_says():
    """Our values come from our own expression trees; Python's evaluator (here, in the test
    only, on our own generated text) agrees on every one."""
    for ex in lt.make_splits("python", SIZES, seed=3)["test"]:
        src = ex.prompt.rsplit("\n", 1)[1]
        assert str(eval(src, {"__builtins__": {"len": len, "max": max, "min": min}})) == ex.target == ex.answer


def test_arithmetic_references_score_full_marks():
    exs = lt.make_splits("arithmetic", SIZES, seed=1)["test"]
    assert all(lt.score_arithmetic(ex.answer, ex.target) == 1.0 for ex in exs)


@needs_wordnet
@pytest.mark.parametrize("task", list(lt.TASKS))
def test_splits_disjoint_seeded_and_references_are_right(task):
    a = lt.make_splits(task, SIZES, seed=0)
    assert {s: len(v) for s, v in a.items()} == SIZES
    prompts = [ex.prompt for exs in a.values() for ex in exs]
    assert len(set(prompts)) == len(prompts)  # disjoint
    assert a == lt.make_splits(task, SIZES, seed=0)  # deterministic for a seed
    assert [e.prompt for e in lt.make_splits(task, SIZES, seed=1)["test"]] != [e.prompt for e in a["test"]]
    how = scorers.task(from_dict(spec_doc("z", {task: lt.TASKS[task].entry})).generation[task])
    for ex in a["test"]:
        if how.kind == "choice":
            assert ex.answer == ex.target == ex.options[ex.label] and len(ex.options) == 4
        else:  # the reference reply passes its own metric, the scorer its spec entry names
            assert how.score(ex.answer, ex) == 1.0, ex


@needs_wordnet
def test_wordnet_question_names_its_answer_among_the_options():
    for ex in lt.make_splits("wordnet", SIZES, seed=0)["test"][:50]:
        listed = [line[2:] for line in ex.prompt.splitlines() if line.startswith("- ")]
        assert listed == list(ex.options) and len(set(listed)) == 4
        gloss = ex.prompt.split('"')[1]
        assert listed[ex.label] not in gloss.lower()


def test_too_small_a_pool_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown LLM task"):
        lt.make_splits("poetry", SIZES, 0)
