"""Scorers of a language model's generated replies, by name: ``SCORERS[name](reply, target) -> float``.

Each scorer is a pure function of the reply's text and the task's target, 1.0 for right and 0.0
for wrong (``code_pass_at_1`` runs the code, in :mod:`featcal.zoo.score.sandbox`):

- ``final_number`` (GSM8K, MATH): the reply's answer is the last number inside its last
  ``\\boxed{...}`` (or ``\\fbox{...}``); else the first number after its last ``####`` (GSM8K's
  answer line); else its last number. The text is read after dropping ``$``, ``\\$`` and ``\\!``,
  with ``{,}`` read as a comma, ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``) as ``a/b`` and the
  Unicode minus as ``-``; a ``%`` after a number is ignored (``50%`` reads 50). A number is an
  optional ``-``, digits with or without thousands commas (``1,000`` is 1000; ``1,2,3`` is three
  numbers), an optional decimal part and an optional ``/denominator``; a ``-`` counts only where no
  letter or digit precedes it (``x-5`` reads 5). The target is a number, or text read the same way
  (a GSM8K solution ending in ``#### 72``). The two are compared **exactly, as rationals**:
  ``5`` = ``5.0`` = ``5.00`` and ``\\boxed{3/4}`` = ``0.75`` = ``\\frac{3}{4}``, but ``1/3`` !=
  ``0.333`` (no tolerance: a rounded answer is wrong). A reply without a number scores 0.
- ``exact_match``: both sides normalised (stripped, lower-cased, runs of white space made one
  space, final ``.,;:!?`` removed); the target is a string or a list of accepted strings.
- ``ifeval`` (IFEval's prompt-level strict accuracy): 1.0 when the reply follows every instruction of
  the target; the checks and their rules are in :mod:`featcal.zoo.score.ifeval`. Call
  :func:`check_ifeval_targets` before generating: it refuses unknown ids and bad kwargs.
- ``code_pass_at_1`` (HumanEval(+), MBPP(+)): the reply's code (see :func:`extract_code`) followed by
  the target's ``tests``, then ``check(entry_point)`` where the tests define ``check`` (HumanEval's
  way; MBPP's asserts call the function themselves), run in the sandbox; 1.0 when it runs to its end.
  An optional ``prompt`` is the task's code prompt: a reply that does not define the entry point is
  taken as its completion, and one that does gets the prompt's import lines. Call
  :func:`check_code_targets` before generating: tests that do not compile, or that import a
  module the sandbox's interpreter lacks (numpy, for EvalPlus), are refused there.

Multiple-choice tasks are scored by log-likelihood with the model, not from a reply: not here.
"""

from __future__ import annotations

import ast
import re
import sys
from fractions import Fraction
from typing import Callable, Iterable, Mapping

from featcal.zoo.score import sandbox
from featcal.zoo.score.ifeval import check_ifeval_targets, ifeval

__all__ = ["SCORERS", "check_code_targets", "check_ifeval_targets", "code_pass_at_1", "exact_match", "final_number"]
__all__ += ["extract_code", "final_answer", "ifeval", "numbers", "normalize", "program"]

# ----------------------------------------------------------------------------- numbers

_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|(?<![\w.])-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}")


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced), None if none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]  # unclosed (a reply cut at its token limit): the rest


def _as_fraction(number: str) -> Fraction | None:
    top, _, bottom = number.replace(",", "").partition("/")
    try:
        value = Fraction(top)
        return value / Fraction(bottom) if bottom else value
    except (ValueError, ZeroDivisionError):
        return None


def numbers(text: str) -> list[Fraction]:
    """The numbers in ``text``, in order, as exact rationals (rules in the module docstring)."""
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\$", "").replace("$", "").replace("\u2212", "-")
    found = (_as_fraction(m) for m in _NUMBER.findall(_FRAC.sub(r"\1/\2", text)))
    return [value for value in found if value is not None]


def final_answer(reply: str) -> Fraction | None:
    """The reply's answer: the last number in its last ``\\boxed{}``, else the first number after its
    last ``####``, else its last number; None when there is none."""
    box = boxed(reply)
    if box is not None:
        found = numbers(box)
        return found[-1] if found else None
    if "####" in reply:
        found = numbers(reply.rpartition("####")[2])
        return found[0] if found else None
    found = numbers(reply)
    return found[-1] if found else None


def _target_number(target) -> Fraction:
    if isinstance(target, bool) or not isinstance(target, (int, float, str, Fraction)):
        raise ValueError(f"final_number's target must be a number or text with one, got {target!r}.")
    value = (
        final_answer(target)
        if isinstance(target, str)
        else Fraction(repr(target) if isinstance(target, float) else target)
    )
    if value is None:
        raise ValueError(f"final_number's target {target!r} holds no number.")
    return value


def final_number(reply: str, target) -> float:
    """1.0 when the reply's final number equals the target's exactly (as rationals)."""
    answer = final_answer(reply)
    return float(answer is not None and answer == _target_number(target))


# ----------------------------------------------------------------------------- exact match


def normalize(text: str) -> str:
    """Stripped, lower-cased, white space collapsed, final ``.,;:!?`` removed."""
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(".,;:!? ")


def exact_match(reply: str, target) -> float:
    """1.0 when the normalised reply equals the normalised target (or one of a list of them)."""
    accepted = [target] if isinstance(target, str) else list(target) if isinstance(target, (list, tuple)) else []
    if not accepted or not all(isinstance(a, str) for a in accepted):
        raise ValueError(f"exact_match's target must be a string or a list of strings, got {target!r}.")
    return float(normalize(reply) in {normalize(a) for a in accepted})


# ----------------------------------------------------------------------------- code

CODE_LIMITS = sandbox.Limits(timeout_s=10.0)
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, flags=re.M) is not None


def extract_code(reply: str, entry_point: str | None = None) -> str:
    """The code of a reply: of its fenced blocks tagged ``python``/``py``/``python3`` or untagged (a
    block left open at the reply's end included), the first that defines ``entry_point``, else the
    longest; a reply without such fences is code as it is."""
    blocks = [body for tag, body in _FENCE.findall(reply) if tag.lower() in ("", "python", "py", "python3")]
    if not blocks:
        return reply
    if entry_point:
        for body in blocks:
            if _defines(body, entry_point):
                return body
    return max(blocks, key=len)


def _tests_imports(tests: str) -> tuple[str, ...]:
    """The top-level modules ``tests`` import (raises SyntaxError where they do not parse)."""
    names = set()
    for node in ast.walk(ast.parse(tests)):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return tuple(sorted(names))


def _code_target(target) -> tuple[str, str | None, str | None]:
    """``(tests, entry_point, prompt)``; ``tests`` may be a list of lines (MBPP's ``test_list`` asserts)."""
    tests = target.get("tests") if isinstance(target, Mapping) else None
    if isinstance(tests, (list, tuple)) and tests and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests)
    if not isinstance(tests, str):
        raise ValueError(
            f"a code target is {{'tests': str or [str], 'entry_point': str?, 'prompt': str?}}, got {target!r:.200}."
        )
    entry, prompt = target.get("entry_point"), target.get("prompt")
    if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
        raise ValueError(f"a code target's entry_point must be a Python name, got {entry!r}.")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"a code target's prompt must be text, got {type(prompt).__name__}.")
    return tests, entry, prompt


def _outside_stdlib(tests: str) -> tuple[str, ...]:
    return tuple(n for n in _tests_imports(tests) if n not in sys.stdlib_module_names)


def check_code_targets(targets: Iterable) -> None:
    """Refuse, before any generation, code targets that are malformed, whose tests do not compile,
    or whose tests import modules the sandbox's interpreter cannot (naming them and the interpreter)."""
    extra: set[str] = set()
    for index, target in enumerate(targets):
        try:
            tests, _, _ = _code_target(target)
            extra |= set(_outside_stdlib(tests))
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"code example {index}: {exc}") from None
    missing = sandbox.missing_modules(tuple(sorted(extra))) if extra else ()
    if missing:
        iso = sandbox.isolation()
        raise ValueError(
            f"the code tests import {list(missing)}, which the sandbox's interpreter {iso.interpreter} cannot "
            f"({iso.describe()}); install them for that interpreter (readable by the user it runs as)."
        )


def program(reply: str, target) -> str:
    """The program run for a reply: its code (completing ``prompt``, or after the prompt's imports),
    the tests, and ``check(entry_point)`` where the tests define ``check``."""
    tests, entry, prompt = _code_target(target)
    code = extract_code(reply, entry)
    if prompt is not None and entry is not None and not _defines(code, entry):
        code = prompt + code
    elif prompt is not None:
        imports = [line for line in prompt.splitlines() if re.match(r"(?:import|from)\s+\w", line)]
        code = "\n".join(imports) + "\n\n" + code
    call = f"\n\ncheck({entry})\n" if entry and _defines(tests, "check") else "\n"
    return code + "\n\n" + tests + call


def code_pass_at_1(reply: str, target) -> float:
    """1.0 when the reply's code passes the target's tests in the sandbox (pass@1 of one greedy reply)."""
    check_code_targets([target])  # the module look-up is cached: one probe per set of modules
    extra = _outside_stdlib(_code_target(target)[0])
    return float(sandbox.run(program(reply, target), CODE_LIMITS, site_packages=bool(extra)).passed)


SCORERS: dict[str, Callable[[str, object], float]] = {
    "final_number": final_number,
    "exact_match": exact_match,
    "ifeval": ifeval,
    "code_pass_at_1": code_pass_at_1,
}
