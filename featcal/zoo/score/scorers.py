"""The one table of what a generative zoo's task may be scored with, by name.

A spec's task names its scorer (``scorer: exact_match``); :func:`task` turns the task's entry into the
:class:`~featcal.zoo.builtin.llm_tasks.Task` that :class:`~featcal.zoo.score.lm.LMZoo` scores with:

- ``exact_match``, ``final_number``, ``ifeval``, ``code_pass_at_1``: a greedy reply, scored against the
  example's target by :data:`featcal.zoo.score.replies.SCORERS` (1 right, 0 wrong; the mean in percent);
- ``strict_match``: the reply equal to the target's text, character for character (FusionBench's
  accuracy on GLUE as text: no normalisation);
- ``spearman`` (GLUE's STS-B as text): each reply and each target text read whole as a float (0 when
  it is not one), Spearman's rank correlation over the whole set, times 100 (FusionBench's
  ``flan-t5_glue_text_generation`` scoring of STS-B);
- ``choice``: no reply; the option whose tokens are likeliest as the reply is the model's answer (ARC's
  way, :func:`~featcal.zoo.builtin.llm_tasks.score_choice`);
- ``none``: the task's expert is merged and its examples calibrate, but nothing scores it (a domain
  whose metric featcal does not have, as MergeBench's safety judge): it is left out of the scores;
- the built-in smollm2 zoo's own (:mod:`featcal.zoo.builtin.llm_tasks`, the spec its recipe writes names
  them): ``answer_is_number`` (the number after the reply's last "answer is", else its last number,
  equal to the target's text), ``first_line`` (the reply's first line, backticks and a final period
  stripped, equal to the target), ``constraint`` (the reply meets the constraint the target holds as
  JSON text: capital letters only, exactly N words, a given last word, JSON with a given key).
"""

from __future__ import annotations

import math
from typing import Sequence

from featcal.zoo.builtin import llm_tasks
from featcal.zoo.builtin.llm_tasks import Example, Task, score_choice
from featcal.zoo.score import replies
from featcal.zoo.spec.schema import GenTaskSpec

GENERATE = ("exact_match", "final_number", "ifeval", "code_pass_at_1")


def strict_match(reply: str, target) -> float:
    """1.0 when the reply is the target's text exactly (FusionBench's GLUE accuracy: the decoded
    reply, special tokens dropped, equal to the decoded label)."""
    return float(reply == str(target))


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation; 0 when either side is constant (no order to agree with)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


def reply_number(text: str) -> float:
    """The whole text read as a float, 0 when it is not one (FusionBench's reading of STS-B replies)."""
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def spearman(answers: Sequence[str], examples: Sequence[Example]) -> float:
    """Spearman's rho (percent) between the replies read as numbers and the targets."""
    if len(answers) < 2:
        return 0.0
    return 100.0 * pearson(
        ranks([reply_number(a) for a in answers]), ranks([reply_number(ex.target) for ex in examples])
    )


SCORERS = {name: ("generate", replies.SCORERS[name]) for name in GENERATE}
SCORERS["strict_match"] = ("generate", strict_match)
SCORERS["spearman"] = ("generate", None)
SCORERS["choice"] = ("choice", None)
SCORERS["none"] = ("none", None)
SCORERS["answer_is_number"] = ("generate", llm_tasks.score_arithmetic)
SCORERS["first_line"] = ("generate", llm_tasks.score_python)
SCORERS["constraint"] = ("generate", llm_tasks.score_instruction)


def task(spec: GenTaskSpec) -> Task:
    """The scoring :class:`Task` of a spec's task entry."""
    kind, fn = SCORERS[spec.scorer]
    if spec.scorer == "choice":
        return Task("choice", score_choice, scorer="choice")
    if spec.scorer == "none":
        return Task("none", None, scorer="none")
    if spec.scorer == "spearman":
        return Task(kind, None, spec.max_new_tokens, corpus=spearman, scorer="spearman")
    return Task(kind, lambda reply, ex: fn(reply, ex.target), spec.max_new_tokens, scorer=spec.scorer)


def check_targets(spec: GenTaskSpec, examples: Sequence[Example]) -> None:
    """Refuse, before any generation, targets the scorer cannot read (naming the task and the fix)."""
    targets = [ex.target for ex in examples]
    try:
        if spec.scorer == "ifeval":
            replies.check_ifeval_targets(targets)
        elif spec.scorer == "code_pass_at_1":
            replies.check_code_targets(targets)
        elif spec.scorer == "final_number":
            for t in targets:
                replies.final_number("0", t)  # raises on a target with no number
        elif spec.scorer == "spearman":
            [float(t) for t in targets]
        elif spec.scorer == "constraint":
            llm_tasks.check_constraints(targets)
        elif spec.scorer in ("strict_match", "answer_is_number", "first_line"):
            bad = [t for t in targets if not isinstance(t, str)]
            if bad:
                raise ValueError(f"a target {bad[0]!r} is not text")
        elif spec.scorer == "exact_match":
            for t in targets:
                replies.exact_match("", t)
        elif spec.scorer == "choice":
            bad = [i for i, ex in enumerate(examples) if not 0 <= ex.label < len(ex.options)]
            if bad:
                raise ValueError(
                    f"example {bad[0]}: label {examples[bad[0]].label} for {len(examples[bad[0]].options)} options"
                )
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"task {spec.task!r}: its targets (column {spec.target!r}) do not fit scorer {spec.scorer!r}: {err}. "
            "Fix: point `target` at the right column (`labels` for an integer class), or pick another scorer."
        ) from None
