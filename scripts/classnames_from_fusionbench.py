"""Maintainer's tool: (re)write featcal/zoo/load/clip_classnames.json from an installed fusion-bench.

FusionBench keeps each CLIP task's class names (in its datasets' label order) and zero-shot
prompts in one small module per task (``fusion_bench/tasks/clip_classification/*.py``: a
``classnames`` list, or ``fine_label`` for CIFAR-100, and ``templates``, a list of one-argument
lambdas). This script runs each of those files on its own (not the package, whose imports need
its full dependency set), turns each template into a ``str.format`` pattern by calling it with
``"{}"``, and writes the tasks featcal knows under their canonical names
(:func:`featcal.zoo.load.classnames.canonical_task`). Tasks already in the JSON are kept as they are;
where FusionBench's differ, the script says so (SVHN: featcal names the digits 'zero'..'nine',
FusionBench '0'..'9').

    python scripts/classnames_from_fusionbench.py [--fusion-bench DIR]

``DIR`` defaults to the installed package (``pip install --no-deps fusion-bench==0.2.33``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from featcal.zoo.load.classnames import DATA, canonical_task  # noqa: E402

# FusionBench's task name -> its module (and the list's name where it is not ``classnames``): the
# 20 tasks of the TALL20 benchmark (Wang et al. 2024), TA8 first.
MODULES = {
    "sun397": "sun397",
    "stanford-cars": "stanford_cars",
    "resisc45": "resisc45",
    "eurosat": "eurosat",
    "svhn": "svhn",
    "gtsrb": "gtsrb",
    "mnist": "mnist",
    "dtd": "dtd",
    "oxford_flowers102": "flower102",
    "pcam": "pcam",
    "fer2013": "fer2013",
    "oxford-iiit-pet": "oxford_iiit_pet",
    "stl10": "stl10",
    "cifar100": ("cifar100", "fine_label"),
    "cifar10": "cifar10",
    "food101": "food101",
    "fashion_mnist": "fashion_mnist",
    "emnist_letters": "emnist_letters",
    "kmnist": "kmnist",
    "rendered-sst2": "rendered_sst2",
}


def read_task(folder: Path, module: str, names: str = "classnames") -> dict:
    """``{"classes", "templates"}`` of one of FusionBench's task modules."""
    scope: dict = {}
    exec(compile((folder / f"{module}.py").read_text(), module, "exec"), scope)  # a data file of lists
    return {"classes": [str(c) for c in scope[names]], "templates": [t("{}") for t in scope["templates"]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fusion-bench", type=Path, help="the fusion_bench package directory")
    args = ap.parse_args(argv)
    pkg = args.fusion_bench
    if pkg is None:
        spec = importlib.util.find_spec("fusion_bench")
        if spec is None or not spec.submodule_search_locations:
            sys.exit(
                "fusion-bench is not installed: pip install --no-deps fusion-bench==0.2.33, or pass --fusion-bench DIR"
            )
        pkg = Path(next(iter(spec.submodule_search_locations)))
    folder = pkg / "tasks" / "clip_classification"
    known = json.loads(DATA.read_text(encoding="utf-8"))
    out, differ = {}, []
    for task, where in MODULES.items():
        module, names = (where, "classnames") if isinstance(where, str) else where
        entry = read_task(folder, module, names)
        key = canonical_task(task)
        if key in known and known[key] != entry:
            differ.append(key)
        out[key] = known.get(key, entry)
    if differ:
        print(f"kept featcal's own entries for {differ}, which differ from FusionBench's", file=sys.stderr)
    DATA.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{DATA}: {len(out)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
