"""lm-eval-harness (PyPI ``lm-eval``) as the evaluator of a language model featcal holds in memory.

Researchers report LLM merges with lm-eval's tasks (GSM8K, ARC, IFEval, ...), so featcal scores a
calibrated causal or seq2seq model with lm-eval itself rather than a copy of its metrics: the model
and its tokenizer go to lm-eval's ``HFLM`` wrapper as objects (no save and reload), the tasks come
from lm-eval's registry or from local task YAML files (``include``), and the results come back as
``{task: {metric: value}}`` for featcal's tables. The numbers are lm-eval's: the same model saved
and scored by ``lm_eval --model hf`` gives the same figures.

Nothing runs because a file asked for it: a local task YAML may name Python code for lm-eval to
import (``!function module.name``); such a file is refused, naming it, unless the caller passes
``allow_code=True`` (``featcal eval --trust-remote-code``). Tasks lm-eval marks unsafe (code
execution, e.g. HumanEval) are never confirmed by featcal. Data sets load from the local disk or
the Hugging Face cache (set ``HF_DATASETS_OFFLINE=1`` where there is no network).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import torch

INSTALL = "pip install lm-eval==0.4.13"


class HarnessError(ValueError):
    """A request lm-eval cannot run as asked; the message names the task or file and the fix."""


def code_in_task_files(include: str | os.PathLike) -> list[str]:
    """``FILE:LINE`` of every ``!function`` tag in the task YAML files under ``include`` (a file
    or a folder): Python code lm-eval would import to run the task."""
    root = Path(include).expanduser()
    files = [root] if root.is_file() else sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")])
    found = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if re.search(r"!function\b", line.split("#", 1)[0]):
                found.append(f"{f}:{i}")
    return found


def _task_manager(include: str | os.PathLike | None, allow_code: bool):
    from lm_eval.tasks import TaskManager

    if include is None:
        return TaskManager()
    root = Path(include).expanduser()
    if not root.exists():
        raise HarnessError(f"lm-eval tasks {str(root)!r}: no such file or folder.")
    code = code_in_task_files(root)
    if code and not allow_code:
        raise HarnessError(
            f"lm-eval task file(s) name Python code to import (!function), at {', '.join(code)}; featcal runs "
            "no code a file asks for. Read that code, then pass --trust-remote-code (allow_code=True) to run it."
        )
    return TaskManager(include_path=str(root if root.is_dir() else root.parent))


def lm_eval_scores(
    model: torch.nn.Module,
    tokenizer,
    tasks: Sequence[str],
    *,
    include: str | os.PathLike | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    allow_code: bool = False,
) -> dict[str, dict[str, float]]:
    """lm-eval's scores of ``model`` (a transformers causal or seq2seq LM, on its device) with
    ``tokenizer`` on ``tasks`` (registry names or the names of task YAMLs under ``include``), the
    first ``limit`` documents of each: ``{task: {metric: value}}`` (metric names as lm-eval's,
    e.g. ``acc,none``; standard errors left out)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise HarnessError(f"lm-eval is not installed: {INSTALL}") from None
    if not tasks:
        raise HarnessError(
            "no lm-eval task given (e.g. --lm-eval arc_easy, or a task YAML's name with --lm-eval-tasks DIR)."
        )
    manager = _task_manager(include, allow_code)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under {str(include)!r}" if include else ""
        raise HarnessError(f"lm-eval knows no task {unknown} in its registry{where}; `lm_eval ls tasks` lists them.")
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        limit=limit,
        num_fewshot=num_fewshot,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=0,
        confirm_run_unsafe_code=False,
    )
    return _numbers(out["results"])


def _numbers(results: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """lm-eval's metrics (its keys are ``metric,filter``) without their standard errors."""
    table = {}
    for task, metrics in results.items():
        row = {
            m: float(v)
            for m, v in metrics.items()
            if "," in m and "_stderr" not in m and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        table[task] = {m: v for m, v in row.items() if math.isfinite(v)}
    return table


def load_lm(path: str | os.PathLike, *, device: str = "cpu", trust_remote_code: bool = False):
    """``(model, tokenizer)`` of a saved language model directory (``featcal calibrate --out``
    writes the base's tokenizer beside the weights): the transformers class its config.json names
    (the library's own classes only), loaded from the local disk, in eval mode on ``device``."""
    import json

    from transformers import AutoTokenizer

    from featcal.model.allowed import library_model_class
    from featcal.model.checkpoints import model_dir_problem

    where = Path(path).expanduser()
    problem = model_dir_problem(where, "--model")
    if problem:
        raise HarnessError(problem)
    archs = json.loads((where / "config.json").read_text()).get("architectures") or []
    if not archs:
        raise HarnessError(f"--model {str(where)!r}: config.json names no architecture; save it with save_pretrained.")
    cls = library_model_class(archs[0], f"--model {str(where)!r}")
    model = cls.from_pretrained(str(where), trust_remote_code=trust_remote_code, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(where), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as err:
        raise HarnessError(
            f"--model {str(where)!r}: no tokenizer could be loaded there ({str(err).splitlines()[0]}); copy the "
            "base model's tokenizer files into it."
        ) from None
    return model.to(device).eval(), tokenizer
