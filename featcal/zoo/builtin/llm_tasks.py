"""The LLM zoo's four tasks in the MergeBench spirit, each with a verifiable metric.

Every example is generated offline with a seed, or read from WordNet 3.0 (Debian
``wordnet-base``, through :mod:`featcal.zoo.builtin.text_data`); nothing comes from a model:

- ``arithmetic``: one- and two-step word problems; scored by exact match of the final
  number (the one after the last "answer is", else the last number in the reply);
- ``python``: "what does this Python expression evaluate to" over expressions we generate,
  the answers computed from our own expression trees (never ``eval``); scored by exact
  match of the reply's first line (whitespace, backticks and a final period stripped);
- ``wordnet``: which of four listed words a WordNet gloss defines, multiple choice scored
  by log-likelihood as ARC is (the option word most likely as the reply, its tokens'
  log-probabilities summed);
- ``instructions``: define a WordNet word under one checkable constraint in the IFEval way
  (capital letters only, exactly N words, end with a given word, JSON with a given key);
  scored by whether the reply meets the constraint.

An example is a :class:`Example`; :data:`TASKS` maps a task's name to its generator and its entry
in the zoo spec the smollm2 recipe writes (how a row of its table is prompted and scored: the
scorers below, by the names :mod:`featcal.zoo.score.scorers` gives them). Scores are pure functions
of the reply (or of the option log-likelihoods) and the target, so the tests check them on
hand-made answers.
"""

from __future__ import annotations

import json
import math
import operator
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from featcal.zoo.builtin import text_data


@dataclass(frozen=True)
class Example:
    """One prompt (the user's turn), the reference reply (fine-tuning and calibration
    target) and what scores it: ``target`` (the exact answer; an instruction's constraint as
    JSON text; a spec task's structured target), ``options`` and ``label`` (multiple choice)."""

    prompt: str
    answer: str
    target: Any = ""
    options: tuple[str, ...] = ()
    label: int = -1

    def row(self) -> dict:
        """The example as a row of a task's table (what a spec's task entry reads back)."""
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "target": self.target,
            "options": list(self.options),
            "label": self.label,
        }


# ------------------------------------------------------------------ arithmetic

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Ella", "Finn", "Gita", "Hugo", "Iris", "Jon", "Kai", "Lena", "Omar", "Pia")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "coins")


def _arithmetic_one(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 9)
    if kind == 0:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == 1:
        a += b
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    if kind == 2:
        return f"{name} buys {b} boxes with {c} {thing} in each. How many {thing} is that?", b * c
    if kind == 3:
        return f"{name} shares {b * c} {thing} equally among {c} friends. How many does each friend get?", b
    return (
        f"{name} has {a} {thing} and buys {b} packs of {c} {thing}. How many {thing} does {name} have now?",
        a + b * c,
    )


def arithmetic(rng: random.Random, n: int) -> list[Example]:
    out = []
    for _ in range(n):
        q, value = _arithmetic_one(rng)
        out.append(Example(q, f"The answer is {value}.", target=str(value)))
    return out


def final_number(reply: str) -> str | None:
    """The number after the last "answer is", else the reply's last number (commas in
    thousands dropped); ``None`` when the reply has no number."""
    text = reply.replace(",", "")
    tail = text.lower().rsplit("answer is", 1)
    nums = re.findall(r"-?\d+(?:\.\d+)?", tail[1] if len(tail) == 2 else text)
    if not nums:
        return None
    picked = nums[0] if len(tail) == 2 else nums[-1]
    return str(int(float(picked))) if float(picked).is_integer() else picked


def score_arithmetic(reply: str, target: str) -> float:
    """1 when the reply's final number (:func:`final_number`) is the target."""
    return float(final_number(reply) == target)


# ------------------------------------------------------------------ python expressions


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


def _expr(rng: random.Random, depth: int) -> tuple[str, int]:
    """``(source, value)`` of a random integer expression; the value is computed here,
    alongside the text, never by evaluating the text."""
    if depth == 0 or rng.random() < 0.3:
        k = rng.randrange(4)
        if k == 0:
            word = rng.choice(("cat", "house", "python", "merge", "tree", "a", "hello"))
            return f"len('{word}')", len(word)
        v = rng.randint(0, 12)
        return str(v), v
    op = rng.choice(("+", "-", "*", "//", "%", "max", "min"))
    (ls, lv), (rs, rv) = _expr(rng, depth - 1), _expr(rng, depth - 1)
    if op in ("max", "min"):
        return f"{op}({ls}, {rs})", (max if op == "max" else min)(lv, rv)
    if op in ("//", "%") and rv == 0:
        rv = rng.randint(1, 5)
        rs = str(rv)
    value = OPS[op](lv, rv)
    return f"({ls} {op} {rs})", value


def python_expressions(rng: random.Random, n: int) -> list[Example]:
    out = []
    for _ in range(n):
        src, value = _expr(rng, rng.choice((1, 2)))
        src = src[1:-1] if src.startswith("(") and src.endswith(")") else src  # the outer brackets
        q = f"What does this Python expression evaluate to? Reply with the value only.\n{src}"
        out.append(Example(q, str(value), target=str(value)))
    return out


def first_line(reply: str) -> str:
    """The reply's first non-empty line, without surrounding whitespace, backticks or a final period."""
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if line.startswith("```"):  # a fenced block: its first line of code
        line = lines[1].strip() if len(lines) > 1 else ""
    return line.rstrip(".").strip("`").strip().rstrip(".").strip()


def score_python(reply: str, target: str) -> float:
    """1 when the reply's first line (:func:`first_line`) is the target."""
    return float(first_line(reply) == target)


# ------------------------------------------------------------------ WordNet


def _glossary() -> list[tuple[str, str]]:
    """``[(word, gloss)]`` of WordNet noun synsets with a one-word lemma (letters only,
    3-12 characters) and a gloss that does not contain the word, in file order."""
    out, seen = [], set()
    for _, text in text_data.wordnet_synsets(text_data.POS_FILES["noun"]):
        lemmas, _, gloss = text.partition(": ")
        word = lemmas.split(", ")[0]
        gloss = re.sub(r"\s*\([^)]*\)\s*", " ", gloss.split(";")[0]).strip().strip('"').strip()
        if not re.fullmatch(r"[a-z]{3,12}", word) or word in gloss.lower() or len(gloss.split()) < 3:
            continue
        if (word, gloss) not in seen:
            seen.add((word, gloss))
            out.append((word, gloss))
    return out


def wordnet_choice(rng: random.Random, n: int) -> list[Example]:
    """Which of four listed words a WordNet gloss defines; the reference reply is the word
    itself (scored by each option word's log-likelihood as the reply, as ARC is scored)."""
    pairs = _glossary()
    words = sorted({w for w, _ in pairs})
    out = []
    for i in rng.sample(range(len(pairs)), min(n, len(pairs))):
        word, gloss = pairs[i]
        options = [word, *rng.sample([w for w in rng.sample(words, 8) if w != word], 3)]
        rng.shuffle(options)
        listing = "\n".join(f"- {o}" for o in options)
        q = f'Which word has this meaning: "{gloss}"?\n{listing}\nAnswer with the word only.'
        out.append(Example(q, word, target=word, options=tuple(options), label=options.index(word)))
    return out


def score_choice(logliks: Sequence[float], ex: Example) -> float:
    """1 when the right option's log-likelihood (summed over its tokens, as the assistant's
    reply) is strictly the highest; a tie, a NaN or a wrong number of options counts as wrong."""
    if len(logliks) != len(ex.options) or any(not math.isfinite(v) for v in logliks):
        return 0.0
    best = max(logliks)
    return float(logliks[ex.label] == best and sum(v == best for v in logliks) == 1)


# ------------------------------------------------------------------ instruction following

END_WORDS = ("indeed", "today", "friend", "always", "done")
CONSTRAINT_KINDS = ("upper", "words", "end", "json")
KEYS = ("answer", "definition", "meaning", "text")


def instructions(rng: random.Random, n: int) -> list[Example]:
    pairs = [(w, g) for w, g in _glossary() if len(g.split()) <= 12]
    out = []
    for i in rng.sample(range(len(pairs)), min(n, len(pairs))):
        word, gloss = pairs[i]
        gloss = " ".join(gloss.split()[:8])
        kind = ("upper", "words", "end", "json")[len(out) % 4]
        ask = f"What is a {word}?" if rng.random() < 0.5 else f'Explain the word "{word}".'
        if kind == "upper":
            rule, reply, c = "Answer in capital letters only.", gloss.upper(), {"kind": "upper"}
        elif kind == "words":
            k = rng.randint(3, min(6, len(gloss.split())))
            rule, reply, c = f"Answer in exactly {k} words.", " ".join(gloss.split()[:k]), {"kind": "words", "n": k}
        elif kind == "end":
            end = rng.choice(END_WORDS)
            rule, reply, c = f'End your answer with the word "{end}".', f"{gloss}, {end}", {"kind": "end", "word": end}
        else:
            key = rng.choice(KEYS)
            rule, reply, c = (
                f'Answer in JSON with the key "{key}".',
                json.dumps({key: gloss}),
                {"kind": "json", "key": key},
            )
        out.append(Example(f"{ask} {rule}", reply, target=constraint_text(c)))
    return out


def constraint_text(constraint: Mapping) -> str:
    """An instruction's constraint as its example's target: JSON text (one column of a table)."""
    return json.dumps(dict(constraint), sort_keys=True)


def _words(text: str) -> list[str]:
    return [w for w in text.split() if re.search(r"[A-Za-z0-9]", w)]


def follows(reply: str, constraint: dict) -> bool:
    """Whether ``reply`` meets the constraint (IFEval's strict check, on the stripped reply)."""
    text, kind = reply.strip(), constraint.get("kind")
    if kind == "upper":
        return bool(re.search(r"[A-Za-z]", text)) and text == text.upper()
    if kind == "words":
        return len(_words(text)) == int(constraint["n"])
    if kind == "end":
        words = _words(text)
        return bool(words) and re.sub(r"[^a-z]", "", words[-1].lower()) == constraint["word"]
    if kind == "json":
        body = re.sub(r"^```(?:json)?\s*|\s*```$", "", text)
        try:
            doc = json.loads(body)
        except ValueError:
            return False
        return isinstance(doc, dict) and constraint["key"] in doc
    raise ValueError(f"unknown constraint kind {kind!r}; expected one of {list(CONSTRAINT_KINDS)}.")


def score_instruction(reply: str, target: str) -> float:
    """1 when the reply meets the constraint that ``target`` holds as JSON text (:func:`constraint_text`)."""
    return float(follows(reply, json.loads(target)))


def check_constraints(targets: Sequence) -> None:
    """Refuse a target that is not a constraint's JSON text of a known kind (before any reply)."""
    for t in targets:
        doc = json.loads(t) if isinstance(t, str) else None
        if not isinstance(doc, dict) or doc.get("kind") not in CONSTRAINT_KINDS:
            raise ValueError(f"target {t!r} is not a constraint's JSON text of kind {list(CONSTRAINT_KINDS)}")


# ------------------------------------------------------------------ the table of tasks


@dataclass(frozen=True)
class Task:
    """How a task is scored: its kind (``generate``: on a greedy reply of at most
    ``max_new_tokens``; ``choice``: on the options' log-likelihoods; ``none``: not scored), its
    score function ``score(answer, example)`` (or ``corpus(answers, examples)`` for a set-level
    metric such as Spearman's), and the spec's name of its scorer (``scorer``, what tables show).
    :func:`featcal.zoo.score.scorers.task` makes one from a spec's entry."""

    kind: str
    score: Callable | None
    max_new_tokens: int = 0
    corpus: Callable | None = None  # (answers, examples) -> percent, for a metric over the whole set
    scorer: str = ""


@dataclass(frozen=True)
class Builtin:
    """A built-in task: its generator ``make(rng, n)``, the data it needs (``wordnet`` or
    nothing), and its entry in the zoo spec the recipe writes (the spec's ``tasks.<task>``: how a
    row of its table, :meth:`Example.row`, is prompted and scored)."""

    make: Callable[[random.Random, int], list[Example]]
    entry: Mapping[str, Any]
    source: str | None = None


_ROW = {"prompt": "{prompt}", "target": "target", "reference": "answer"}  # the table's columns, as Example.row
TASKS = {
    "arithmetic": Builtin(arithmetic, {**_ROW, "scorer": "answer_is_number", "max_new_tokens": 12}),
    "python": Builtin(python_expressions, {**_ROW, "scorer": "first_line", "max_new_tokens": 8}),
    "wordnet": Builtin(wordnet_choice, {**_ROW, "options": "options", "scorer": "choice"}, source="wordnet"),
    "instructions": Builtin(instructions, {**_ROW, "scorer": "constraint", "max_new_tokens": 32}, source="wordnet"),
}


def make_splits(task: str, sizes: dict[str, int], seed: int) -> dict[str, list[Example]]:
    """``{split: [Example]}`` for the splits in ``sizes`` (in its order), disjoint by prompt:
    one seeded pool, duplicates dropped, cut in order. Raises when the pool is too small."""
    if task not in TASKS:
        raise ValueError(f"unknown LLM task {task!r}; choose from {sorted(TASKS)}.")
    need = sum(sizes.values())
    rng = random.Random(f"{seed}/{task}")
    pool, seen = [], set()
    for ex in TASKS[task].make(rng, 2 * need + 50):
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            pool.append(ex)
    if len(pool) < need:
        raise ValueError(f"task {task!r}: only {len(pool)} distinct examples, {need} needed; lower the split sizes.")
    out, start = {}, 0
    for split, k in sizes.items():
        out[split] = pool[start : start + k]
        start += k
    return out
