"""Class names and zero-shot prompt templates for the 8-, 14- and 20-task CLIP benchmarks.

The class names and prompts are the ones the CLIP task-vector literature (and
FusionBench, whose task names are used as keys) uses for SUN397, Stanford
Cars, RESISC45, EuroSAT, SVHN, GTSRB, MNIST and DTD (TA8), then Flowers102, PCam,
FER2013, Oxford-IIIT Pet, STL10, CIFAR-100 (TALL14), CIFAR-10, Food101,
Fashion-MNIST, EMNIST letters, KMNIST and Rendered SST-2 (TALL20), the last 12 as
FusionBench 0.2.33 lists them (scripts/classnames_from_fusionbench.py writes them). Class ``k`` of a list is
label ``k`` of the dataset as FusionBench distributes it. A template is a
``str.format`` pattern with one ``{}`` for the class name.

They are data, kept in ``clip_classnames.json`` beside this module (shipped as
package data): ``{task: {"classes": [...], "templates": [...]}}``, one name per
line, in the datasets' label order.

Registry: ``TASKS`` maps a task name to ``(classes, templates)``;
:func:`classes_and_templates` looks one up (aliases such as ``stanford_cars``
or ``tanganke/sun397`` are accepted).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("clip_classnames.json")


def _read_tasks(path: Path) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """``{task: (classes, templates)}`` from the JSON file, in its order."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {task: (tuple(entry["classes"]), tuple(entry["templates"])) for task, entry in raw.items()}


TASKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = _read_tasks(DATA)

# The 8 tasks of the Task Arithmetic benchmark, in the order the paper reports them.
TA8 = ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")


def canonical_task(name: str) -> str:
    """``tanganke/stanford_cars``, ``Stanford_Cars``, ``stanford-cars`` -> ``stanford-cars``."""
    key = name.rsplit("/", 1)[-1].lower().replace("_", "-")
    return key


def classes_and_templates(task: str) -> tuple[list[str], list[str]]:
    """``(class names, prompt templates)`` of a known task."""
    key = canonical_task(task)
    if key not in TASKS:
        raise KeyError(
            f"no built-in class names for task {task!r}; known tasks: {sorted(TASKS)}. "
            "Give `classes` and `templates` in the spec's head entry instead."
        )
    classes, templates = TASKS[key]
    return list(classes), list(templates)
