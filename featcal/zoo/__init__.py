"""Zoos: a base model, its experts, frozen heads and data, from a name or a path.

    from featcal.zoo import load_any, load_demo
    zoo = load_demo()                    # the embedded demo, built offline on first use
    zoo = load_any("demo-fashion")       # plus two Fashion-MNIST tasks (apt: dataset-fashion-mnist)
    zoo = load_any("assets/zoos/clip-vit-b32-ta8.yaml")   # real models, from a YAML spec
    zoo = load_any("path/to/zoo-dir")    # any directory in the demo's on-disk layout
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from featcal.zoo.core import SPLITS, TaskData, Zoo, evaluate
from featcal.zoo.demo import DEMO_VERSION, build_demo, cache_dir, demo_path, load_demo
from featcal.zoo.io import OutputExistsError, load_model, save_model
from featcal.zoo.scores import average, expert_accuracies, normalized, summary, write_scores
from featcal.zoo.store import is_zoo_dir, read_zoo_dir

__all__ = [
    "SPLITS", "TaskData", "Zoo", "evaluate", "DEMO_VERSION", "build_demo", "cache_dir",
    "demo_path", "load_demo", "load_any", "NAMES", "OutputExistsError", "load_model",
    "save_model", "average", "expert_accuracies", "normalized", "summary", "write_scores",
    "is_zoo_dir", "read_zoo_dir",
]

# Built-in zoo names and the ``load_demo`` variant each stands for.
NAMES = {"demo": "default", "demo-fashion": "fashion"}


def load_any(name_or_path: str | os.PathLike, progress: bool = True, rebuild: bool = False,
             device: str = "cpu") -> Zoo:
    """A zoo from a name or a path:

    - ``demo`` / ``demo-fashion``: the embedded demo zoo (built and cached on first use);
    - a ``.yaml`` / ``.yml`` file: a spec of real models (:func:`featcal.zoo.spec.load`);
    - a directory in the demo's layout (``meta.json`` of kind ``featcal-zoo``).

    ``rebuild`` applies to the demo zoos only. Raises ``FileNotFoundError`` naming
    the accepted forms when nothing matches.
    """
    key = str(name_or_path)
    if key in NAMES:
        zoo = load_demo(rebuild=rebuild, progress=progress, variant=NAMES[key])
        return _to(zoo, device)
    path = Path(key).expanduser()
    if path.suffix.lower() in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"zoo spec {key!r} does not exist.")
        return _spec_module().load(path, device=device)
    if path.is_dir() and is_zoo_dir(path):
        return _to(read_zoo_dir(path), device)
    what = "is a directory but not a featcal zoo (no meta.json)" if path.is_dir() else "does not exist"
    raise FileNotFoundError(
        f"zoo {key!r} {what}; give {' or '.join(repr(n) for n in NAMES)}, a .yaml spec, "
        "or a zoo directory.")


def _spec_module():
    try:
        return importlib.import_module("featcal.zoo.spec")
    except ModuleNotFoundError as err:
        if err.name != "featcal.zoo.spec":
            raise
        raise FileNotFoundError("YAML zoo specs need featcal.zoo.spec, which is not installed "
                                "in this checkout.") from None


def _to(zoo: Zoo, device: str) -> Zoo:
    if str(device) != "cpu":
        for m in [zoo.base, *zoo.experts.values(), *zoo.heads.values()]:
            m.to(device)
    return zoo
