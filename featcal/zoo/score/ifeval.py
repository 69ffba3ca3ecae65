"""IFEval's verifiable instructions, checked on a reply (Zhou et al. 2023, arXiv 2311.07911).

A target is a list of ``{"instruction_id", "kwargs"}`` (or an IFEval row, with parallel
``instruction_id_list`` and ``kwargs``; ``None`` kwargs are dropped, as the published data carries
every key in every row). :func:`ifeval` is the prompt-level *strict* accuracy (1.0 when every
instruction is followed, on the reply as it is); :func:`ifeval_followed` gives each instruction's
result. :data:`IFEVAL` holds 24 of the 25 instruction ids of IFEval's data, each checked by the
reference implementation's rule, except where said here:

- ``language:response_language`` is not supported (it needs a language detector):
  :func:`check_ifeval_targets` refuses it, :func:`ifeval_supported` tells which rows to keep;
- ``change_case:english_lowercase`` / ``english_capital`` check the case only, not that the text
  is English;
- words are runs of ``\\w`` characters (IFEval's count); sentences end at ``.``, ``!`` or ``?``
  followed by white space or the text's end, simpler than IFEval's splitter ("e.g. this" makes
  two sentences here, one there);
- keywords match as literal text, case-insensitively (IFEval reads them as regular expressions);
  forbidden words as whole words.

:func:`check_ifeval_targets` runs before any generation: an unknown instruction id, a missing or
unknown kwarg, a relation other than ``less than`` / ``at least`` raise a ValueError naming the
example, the instruction and what is expected.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Iterable, Mapping

RELATIONS = ("less than", "at least")  # IFEval's two comparisons: count < n, count >= n


def _compare(count: int, n: int, relation: str) -> bool:
    return count < n if relation == "less than" else count >= n


def count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))


def count_sentences(text: str) -> int:
    return sum(1 for piece in re.split(r"(?<=[.!?])\s+", text) if re.search(r"\w", piece))


def _paragraphs_by_stars(text: str, n: int) -> bool:
    """IFEval's number_paragraphs: ``***`` dividers; an empty paragraph between two fails."""
    parts = re.split(r"\s?\*\*\*\s?", text)
    inner_empty = any(not p.strip() for p in parts[1:-1])
    count = sum(1 for p in parts if p.strip())
    return not inner_empty and count == n


def _nth_paragraph_starts(text: str, kw: dict) -> bool:
    parts = [p for p in text.split("\n\n") if p.strip()]
    n, first = kw["nth_paragraph"], kw["first_word"].lower()
    if len(parts) != kw["num_paragraphs"] or not 1 <= n <= len(parts):
        return False
    word = re.match(r"[^.,?!'\"]*", parts[n - 1].split()[0].lstrip("'\"")).group(0)
    return word.lower() == first


def _bullets(text: str) -> int:
    return len(re.findall(r"^\s*\*[^*].*$", text, flags=re.M)) + len(re.findall(r"^\s*-.*$", text, flags=re.M))


def _is_json(text: str) -> bool:
    body = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    try:
        json.loads(body.removesuffix("```").strip())
    except ValueError:
        return False
    return True


def _highlights(text: str) -> int:
    single = [h for h in re.findall(r"\*[^\n*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", text) if h[2:-2].strip()]
    return len(single) + len(double)


def _postscript(text: str, marker: str) -> bool:
    pattern = {"P.P.S": r"\s*p\.\s?p\.\s?s", "P.S.": r"\s*p\.\s?s\."}.get(marker, r"\s*" + re.escape(marker.lower()))
    return re.search(pattern + ".*$", text.lower(), flags=re.M) is not None


def _two_responses(text: str) -> bool:
    parts = text.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    kept = [p.strip() for p in parts if p.strip()]
    return len(kept) == 2 and kept[0] != kept[1]


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, flags=re.I))


_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
_N, _REL, _WORDS = "int", "relation", "words"  # kinds of kwargs, checked by check_ifeval_targets
# instruction id: (check(reply, kwargs) -> followed, {kwarg: kind})
IFEVAL: dict[str, tuple[Callable[[str, dict], bool], dict[str, str]]] = {
    "length_constraints:number_words": (
        lambda r, k: _compare(count_words(r), k["num_words"], k["relation"]),
        {"num_words": _N, "relation": _REL},
    ),
    "length_constraints:number_sentences": (
        lambda r, k: _compare(count_sentences(r), k["num_sentences"], k["relation"]),
        {"num_sentences": _N, "relation": _REL},
    ),
    "length_constraints:number_paragraphs": (
        lambda r, k: _paragraphs_by_stars(r, k["num_paragraphs"]),
        {"num_paragraphs": _N},
    ),
    "length_constraints:nth_paragraph_first_word": (
        _nth_paragraph_starts,
        {"num_paragraphs": _N, "nth_paragraph": _N, "first_word": "str"},
    ),
    "detectable_format:number_bullet_lists": (lambda r, k: _bullets(r) == k["num_bullets"], {"num_bullets": _N}),
    "detectable_format:json_format": (lambda r, k: _is_json(r), {}),
    "detectable_format:title": (lambda r, k: any(t[2:-2].strip() for t in re.findall(r"<<[^\n]+>>", r)), {}),
    "detectable_format:number_highlighted_sections": (
        lambda r, k: _highlights(r) >= k["num_highlights"],
        {"num_highlights": _N},
    ),
    "detectable_format:multiple_sections": (
        lambda r, k: (
            len(re.split(r"\s?" + re.escape(k["section_spliter"].strip()) + r"\s?\d+\s?", r)) - 1 >= k["num_sections"]
        ),
        {"section_spliter": "str", "num_sections": _N},
    ),
    "detectable_format:constrained_response": (lambda r, k: any(o in r for o in _OPTIONS), {}),
    "detectable_content:number_placeholders": (
        lambda r, k: len(re.findall(r"\[.*?\]", r)) >= k["num_placeholders"],
        {"num_placeholders": _N},
    ),
    "detectable_content:postscript": (
        lambda r, k: _postscript(r, k["postscript_marker"].strip()),
        {"postscript_marker": "str"},
    ),
    "change_case:english_lowercase": (lambda r, k: r.islower(), {}),
    "change_case:english_capital": (lambda r, k: r.isupper(), {}),
    "change_case:capital_word_frequency": (
        lambda r, k: _compare(
            sum(w.isupper() for w in re.findall(r"\w+", r)), k["capital_frequency"], k["capital_relation"]
        ),
        {"capital_frequency": _N, "capital_relation": _REL},
    ),
    "keywords:existence": (lambda r, k: all(_count(re.escape(w), r) for w in k["keywords"]), {"keywords": _WORDS}),
    "keywords:forbidden_words": (
        lambda r, k: not any(_count(r"\b" + re.escape(w) + r"\b", r) for w in k["forbidden_words"]),
        {"forbidden_words": _WORDS},
    ),
    "keywords:frequency": (
        lambda r, k: _compare(_count(re.escape(k["keyword"].strip()), r), k["frequency"], k["relation"]),
        {"keyword": "str", "frequency": _N, "relation": _REL},
    ),
    "keywords:letter_frequency": (
        lambda r, k: _compare(r.lower().count(k["letter"].lower()), k["let_frequency"], k["let_relation"]),
        {"letter": "str", "let_frequency": _N, "let_relation": _REL},
    ),
    "punctuation:no_comma": (lambda r, k: "," not in r, {}),
    "startend:end_checker": (
        lambda r, k: r.strip().strip('"').lower().endswith(k["end_phrase"].strip().lower()),
        {"end_phrase": "str"},
    ),
    "startend:quotation": (lambda r, k: len(r.strip()) > 1 and r.strip()[0] == r.strip()[-1] == '"', {}),
    "combination:two_responses": (lambda r, k: _two_responses(r), {}),
    "combination:repeat_prompt": (
        lambda r, k: r.strip().lower().startswith(k["prompt_to_repeat"].strip().lower()),
        {"prompt_to_repeat": "str"},
    ),
}


def _kwarg_problem(name: str, kind: str, value) -> str | None:
    if kind == _N and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        return f"{name} must be a whole number >= 0, got {value!r}"
    if kind == _REL and value not in RELATIONS:
        return f"{name} must be one of {RELATIONS}, got {value!r}"
    if kind == "str" and not (isinstance(value, str) and value.strip()):
        return f"{name} must be non-empty text, got {value!r}"
    if kind == _WORDS and not (isinstance(value, (list, tuple)) and all(isinstance(w, str) and w for w in value)):
        return f"{name} must be a list of words, got {value!r}"
    return None


def ifeval_instructions(target) -> list[tuple[str, dict]]:
    """``[(instruction_id, kwargs)]`` of one target, checked; raises ValueError naming what is wrong."""
    if isinstance(target, Mapping) and "instruction_id_list" in target:
        ids, kwargs = (
            list(target["instruction_id_list"]),
            list(target.get("kwargs") or [{}] * len(target["instruction_id_list"])),
        )
        if len(ids) != len(kwargs):
            raise ValueError(f"IFEval target: {len(ids)} instruction ids but {len(kwargs)} kwargs.")
        target = [{"instruction_id": i, "kwargs": k} for i, k in zip(ids, kwargs)]
    if isinstance(target, (str, bytes, Mapping)) or not isinstance(target, Iterable):
        raise ValueError(f"an IFEval target is a list of {{'instruction_id', 'kwargs'}}, got {type(target).__name__}.")
    out = []
    for item in target:
        iid = item.get("instruction_id") if isinstance(item, Mapping) else None
        if iid not in IFEVAL:
            raise ValueError(f"IFEval instruction {iid!r} is not supported; the supported ones: {sorted(IFEVAL)}.")
        kwargs = {k: v for k, v in (item.get("kwargs") or {}).items() if v is not None}
        expected = IFEVAL[iid][1]
        problems = [f"unknown kwarg {k!r}" for k in kwargs if k not in expected]
        problems += [f"missing kwarg {k!r}" for k in expected if k not in kwargs]
        problems += [
            p for k, kind in expected.items() if k in kwargs for p in [_kwarg_problem(k, kind, kwargs[k])] if p
        ]
        if problems:
            raise ValueError(
                f"IFEval instruction {iid!r}: {'; '.join(problems)} (expected kwargs: {sorted(expected)})."
            )
        out.append((iid, kwargs))
    return out


def check_ifeval_targets(targets: Iterable) -> None:
    """Refuse, before any generation, a task whose targets name an unknown instruction or bad kwargs."""
    for index, target in enumerate(targets):
        try:
            ifeval_instructions(target)
        except ValueError as exc:
            raise ValueError(f"IFEval example {index}: {exc}") from None


def ifeval_followed(reply: str, target) -> list[bool]:
    """For each instruction of the target, whether the reply follows it (instruction-level accuracy)."""
    return [IFEVAL[iid][0](reply, kwargs) for iid, kwargs in ifeval_instructions(target)]


def ifeval(reply: str, target) -> float:
    """1.0 when the reply follows every instruction (IFEval's prompt-level strict accuracy)."""
    return float(all(ifeval_followed(reply, target)))


def ifeval_supported(target) -> bool:
    """Whether every instruction id of a target is one :data:`IFEVAL` checks (to filter IFEval's
    rows before :func:`check_ifeval_targets`)."""
    try:
        ids = target["instruction_id_list"] if isinstance(target, Mapping) else [i["instruction_id"] for i in target]
    except (KeyError, TypeError):
        return False
    return all(i in IFEVAL for i in ids)
