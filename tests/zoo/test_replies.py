"""Scorers of generated replies (featcal.zoo.score.replies): each rule of the module docstring,
with its tricky cases, and the checks that refuse bad targets before any generation."""

from __future__ import annotations

from fractions import Fraction

import pytest

from featcal.zoo.score import replies
from featcal.zoo.score.replies import (
    SCORERS,
    check_code_targets,
    code_pass_at_1,
    exact_match,
    extract_code,
    final_answer,
    final_number,
    numbers,
    program,
)

# ----------------------------------------------------------------------------- final_number


@pytest.mark.parametrize(
    "reply, target",
    [
        ("The answer is 42.", 42),
        ("So she has -7 apples left (a debt).", -7),
        ("x-5 = 3, so x = 8", 8),
        ("It costs $1,000 in total.", 1000),
        ("It costs $1,000.", "Adding up: 600 + 400 = 1000\n#### 1,000"),  # a GSM8K solution as target
        ("Total: 1,234,567", 1234567),
        ("#### 18\nI hope these 2 lines help", 18),  # the first number after ####
        ("First 3 then 5 ... \\boxed{3/4}", 0.75),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{\\dfrac{3}{4}}", Fraction(3, 4)),
        ("We get \\boxed{7} first, then finally \\boxed{x = \\frac{1}{2}}", 0.5),  # the last box, nested braces
        ("The result is 5.0", 5),
        ("5.00", "5"),
        ("It rose by 50%.", 50),
        ("The total is \u22123.", -3),  # Unicode minus
        ("$\\$12{,}500$", 12500),
        ("The probability is 0.1", 0.1),
    ],
)
def test_final_number_right(reply, target):
    assert final_number(reply, target) == 1.0


@pytest.mark.parametrize(
    "reply, target",
    [
        ("The answer is 41.", 42),
        ("1/3", 0.333),  # exact rationals: a rounded answer is wrong
        ("0.333", Fraction(1, 3)),
        ("There is no number here.", 3),
        ("\\boxed{}", 0),  # an empty box is an empty answer, not the numbers before it
        ("#### no answer", 0),
        ("The answer is 4, not 5", 4),  # the last number: 5
        ("1,2,3", 123),  # a list, not a thousands-separated number
        ("from 10-20", -20),  # a hyphen after a digit is not a minus sign
    ],
)
def test_final_number_wrong(reply, target):
    assert final_number(reply, target) == 0.0


def test_numbers_and_final_answer():
    assert numbers("-3/4, 1/0 and .5") == [Fraction(-3, 4), Fraction(1, 2)]  # 1/0 is no number
    assert final_answer("\\boxed{12") == 12  # a box left open at the reply's end
    assert final_answer("nothing") is None


@pytest.mark.parametrize("target", [None, True, "no number", [1, 2]])
def test_final_number_refuses_a_target_without_a_number(target):
    with pytest.raises(ValueError, match="final_number"):
        final_number("42", target)


# ----------------------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    "reply, target, score",
    [
        ("  Paris. ", "paris", 1.0),
        ("New   York\n", "new york", 1.0),
        ("Paris!?", "Paris", 1.0),
        ("Lyon", ["Paris", "lyon"], 1.0),
        ("Paris is", "Paris", 0.0),
        ("par is", "Paris", 0.0),
        ("U.S.A.", "u.s.a", 1.0),
    ],
)
def test_exact_match(reply, target, score):
    assert exact_match(reply, target) == score


@pytest.mark.parametrize("target", [3, [], ["a", 1]])
def test_exact_match_refuses_a_bad_target(target):
    with pytest.raises(ValueError, match="exact_match"):
        exact_match("a", target)


# ----------------------------------------------------------------------------- code


def test_extract_code_picks_the_block_that_defines_the_entry_point():
    reply = (
        "Here is an example:\n```python\nprint(add(1, 2))\n```\nAnd the code:\n"
        "```python\ndef add(a, b):\n    return a + b\n```\nShell: ```bash\nls\n```"
    )
    assert extract_code(reply, "add").strip() == "def add(a, b):\n    return a + b"
    assert extract_code(reply).strip() == "def add(a, b):\n    return a + b"  # the longest python block
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # no fences: as it is
    assert extract_code("Sure!\n```py\ndef f():\n    return 1").strip() == "def f():\n    return 1"  # left open


HUMANEVAL = {
    "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "entry_point": "total",
    "tests": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
}
MBPP = {"tests": "assert is_even(4)\nassert not is_even(7)\n", "entry_point": "is_even"}


def test_program_appends_the_check_call_only_where_the_tests_define_check():
    p = program("```python\ndef total(xs):\n    return sum(xs)\n```", HUMANEVAL)
    assert p.rstrip().endswith("check(total)") and p.startswith("from typing import List")
    assert "check(" not in program("def is_even(n):\n    return n % 2 == 0\n", MBPP)


@pytest.mark.parametrize(
    "reply, target, score",
    [
        ("```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```", HUMANEVAL, 1.0),  # needs the import
        ("    return sum(xs)\n", HUMANEVAL, 1.0),  # a completion of the prompt
        ("```python\ndef total(xs):\n    return max(xs)\n```", HUMANEVAL, 0.0),
        ("def is_even(n):\n    return n % 2 == 0\n", MBPP, 1.0),
        ("def is_even(n):\n    return True\n", MBPP, 0.0),
        ("def is_even(n):\n    import os\n    os.system('true')\n    return n % 2 == 0\n", MBPP, 0.0),
        ("def is_even(n:\n", MBPP, 0.0),
    ],
)
def test_code_pass_at_1(reply, target, score):
    assert code_pass_at_1(reply, target) == score


def test_code_targets_are_checked_before_generation():
    check_code_targets([HUMANEVAL, MBPP])
    with pytest.raises(ValueError, match="code example 1"):
        check_code_targets([MBPP, {"tests": "assert f(1) ==\n"}])
    with pytest.raises(ValueError, match="entry_point"):
        check_code_targets([{"tests": "assert True", "entry_point": "not a name"}])
    with pytest.raises(ValueError, match="tests"):
        check_code_targets([{"test": "assert True"}])
    with pytest.raises(ValueError, match="featcal_no_such_module"):
        check_code_targets([{"tests": "import featcal_no_such_module\nassert True\n"}])
    with pytest.raises(ValueError, match="featcal_no_such_module"):
        code_pass_at_1("x = 1", {"tests": "import featcal_no_such_module\n"})


# ----------------------------------------------------------------------------- the registry


def test_scorers_by_name():
    assert set(SCORERS) == {"final_number", "exact_match", "ifeval", "code_pass_at_1"}
    assert "multiple_choice" not in SCORERS  # log-likelihood based: scored with the model
    assert SCORERS["final_number"]("#### 3", 3) == 1.0
    with pytest.raises(ValueError, match="not supported"):  # re-exported for the task builders
        replies.check_ifeval_targets([[{"instruction_id": "no:such", "kwargs": {}}]])
