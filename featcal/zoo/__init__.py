"""Zoos: a base model, its experts, frozen heads and data, from a name or a path.

    from featcal.zoo import load_any, load_demo
    zoo = load_demo()                    # the embedded demo, built offline on first use
    zoo = load_any("demo-fashion")       # plus two Fashion-MNIST tasks (apt: dataset-fashion-mnist)
    zoo = load_any("real-text")          # a real MiniLM text encoder on real text tasks (packages: docs/install.md)
    zoo = load_any("smollm2")            # SmolLM2-135M-Instruct and four LoRA experts (an LLM zoo)
    zoo = load_any("assets/zoos/clip-vit-b32-ta8.yaml")   # real models, from a YAML spec
    zoo = load_any("path/to/zoo-dir")    # any directory in the demo's on-disk layout

:func:`load_any` is the one loader; the command line and the app call it.

The package's folders:

- :mod:`featcal.zoo.spec`: what a zoo spec says and where the models and data it names are;
- :mod:`featcal.zoo.load`: loading a located spec into a ``Zoo`` (models, heads, data);
- :mod:`featcal.zoo.score`: scoring models on a zoo's tasks (summaries, generated replies, lm-eval);
- :mod:`featcal.zoo.formats`: other tools' files (FusionBench model pools) read as specs;
- :mod:`featcal.zoo.builtin`: the built-in zoos' recipes (demo, demo-fashion, real-text, smollm2);
- beside them, the ``Zoo`` itself (:mod:`~featcal.zoo.core`), text inputs (:mod:`~featcal.zoo.tokens`)
  and the on-disk layout (:mod:`~featcal.zoo.io`, :mod:`~featcal.zoo.store`).

The modules import one way, spec <- load <- build (``tests/repo/test_layers.py`` holds the order).
"""

from __future__ import annotations

import os
from pathlib import Path

from featcal.zoo.builtin.demo import DEMO_VERSION, build_demo, cache_dir, demo_path, load_demo
from featcal.zoo.builtin.realtext import load_realtext, realtext_path
from featcal.zoo.core import SPLITS, TaskData, Zoo, evaluate
from featcal.zoo.formats import fusionbench
from featcal.zoo.io import OutputExistsError, load_model, one_load_at_a_time, save_model
from featcal.zoo.load import from_spec, lm_dir
from featcal.zoo.score.scores import average, expert_accuracies, normalized, summary, write_scores
from featcal.zoo.store import is_zoo_dir, read_zoo_dir

__all__ = [
    "SPLITS",
    "TaskData",
    "Zoo",
    "evaluate",
    "DEMO_VERSION",
    "build_demo",
    "cache_dir",
    "demo_path",
    "load_demo",
    "load_realtext",
    "load_any",
    "source_path",
    "NAMES",
    "BUILT",
    "OutputExistsError",
    "load_model",
    "save_model",
    "average",
    "expert_accuracies",
    "normalized",
    "summary",
    "write_scores",
    "is_zoo_dir",
    "read_zoo_dir",
]


def _load_smollm2(rebuild: bool = False, progress: bool = True) -> Zoo:
    from featcal.zoo.builtin.smollm2 import load_smollm2  # imports peft and transformers' Llama only when asked

    return load_smollm2(rebuild=rebuild, progress=progress)


# Built-in zoo names and the ``load_demo`` variant each stands for ...
NAMES = {"demo": "default", "demo-fashion": "fashion"}
# ... and the built-in zoos made by other builders.
BUILT = {"real-text": load_realtext, "smollm2": _load_smollm2}


@one_load_at_a_time
def load_any(name_or_path: str | os.PathLike, progress: bool = True, rebuild: bool = False, device: str = "cpu") -> Zoo:
    """A zoo from a name or a path, its models and heads on ``device`` in eval mode:

    - ``demo`` / ``demo-fashion``: the embedded demo zoo (built and cached on first use);
    - ``real-text``: the real text zoo (built and cached on first use from installed packages);
    - ``smollm2``: the LLM zoo (:mod:`featcal.zoo.builtin.smollm2`, likewise);
    - a ``.yaml`` / ``.yml`` file: a spec of real models (:func:`featcal.zoo.load.from_spec.load`), or a
      FusionBench CLIP model pool (:mod:`featcal.zoo.formats.fusionbench`);
    - a directory in the demo's layout (``meta.json`` of kind ``featcal-zoo``); an LLM zoo's (the
      smollm2 build's) through the spec in it (:mod:`featcal.zoo.load.lm_dir`).

    ``~`` and ``$VARS`` in a path are expanded. ``rebuild`` applies to the built-in
    zoos only; ``progress`` shows their build's progress bars. Raises ``FileNotFoundError``
    naming the accepted forms when nothing matches. Safe from several threads: one load runs
    at a time (:func:`featcal.zoo.io.one_load_at_a_time`).
    """
    key = str(name_or_path)
    if key in NAMES:
        return _on(load_demo(rebuild=rebuild, progress=progress, variant=NAMES[key]), device)
    if key in BUILT:
        return _on(BUILT[key](rebuild=rebuild, progress=progress), device)
    path = Path(os.path.expandvars(key)).expanduser()
    if path.suffix.lower() in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"zoo spec {key!r} does not exist.")
        if fusionbench.is_pool(path):  # a FusionBench model pool, read as the spec it makes
            return _on(from_spec.load(fusionbench.pool_spec(path), device=device), device)
        return _on(from_spec.load(path, device=device), device)
    if path.is_dir() and is_zoo_dir(path):
        return _on(lm_dir.load(path, device=device) if lm_dir.is_lm_dir(path) else read_zoo_dir(path), device)
    what = "is a directory but not a featcal zoo (no meta.json)" if path.is_dir() else "does not exist"
    raise FileNotFoundError(
        f"zoo {key!r} {what}; give {', '.join(repr(n) for n in [*NAMES, *BUILT])}, a .yaml spec, or a zoo directory."
    )


def source_path(name_or_path: str | os.PathLike) -> Path | None:
    """Where :func:`load_any` reads ``name_or_path`` from (a built-in zoo's cache directory,
    the spec file, the zoo directory), None when nothing is there yet (an output must lie
    apart from it; the spec's own models are known once it is loaded, :meth:`Zoo.input_paths`)."""
    key = str(name_or_path)
    if key in NAMES:
        return demo_path(NAMES[key])
    if key == "smollm2":
        from featcal.zoo.builtin.smollm2 import smollm2_path

        return smollm2_path()
    if key == "real-text":
        return realtext_path()
    path = Path(os.path.expandvars(key)).expanduser()
    return path if path.exists() else None


def _on(zoo: Zoo, device: str) -> Zoo:
    """The zoo's models and heads moved to ``device`` (in place) and in eval mode."""
    for m in [zoo.base, *zoo.experts.values(), *zoo.heads.values()]:
        m.to(device).eval()
    return zoo
