"""The zoo the app works on, without Streamlit: load or build it, explain a failure to load,
describe its models and splits, and the CPU threads its work gets.

Each function is one call into :mod:`featcal.zoo` (or a small reshaping of what it
returns); :mod:`app.compute` holds the calibration and the scores. The helpers marked
*belongs in ...* are small pure functions the library does not offer yet.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pandas as pd
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
FIX_SPEC = (
    "Fix: pick the embedded demo, or give the path of a zoo spec YAML (examples in assets/zoos/) "
    "or of a zoo directory (one holding meta.json)."
)


def device() -> str:
    """The GPU when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_zoo(source: str, device: str):
    """``demo`` / ``demo-fashion`` / a spec YAML / a zoo directory -> ``Zoo`` on ``device``
    (:func:`featcal.zoo.load_any`; ``~`` and ``$VARS`` in paths are expanded; one load at a
    time: a zoo picked while another loads waits for it)."""
    from featcal.zoo import load_any

    if not Path(os.path.expandvars(source)).expanduser().exists() and (REPO / source).exists():
        source = str(REPO / source)  # the example specs, from any working directory
    return load_any(source, progress=False, device=device)


def block_names(zoo) -> list[str] | None:
    """The names the pages give the zoo's blocks (:func:`featcal.model.arch.block_axis_names`): None
    for one stack of blocks, else every block's name in forward order, at the tables' block numbers."""
    from featcal.model.arch import block_axis_names

    return block_axis_names(zoo.base)


def zoo_needs_build(source: str, ready: set[str]) -> bool:
    """Whether loading ``source`` would build a demo zoo first (no current shipped copy or cache).
    A "no" is remembered in ``ready`` (the server's, :class:`app.calibrations.Calibrations`): the
    check hashes the shipped files (about 0.1 s), too slow for every rerun."""
    from featcal.zoo import NAMES
    from featcal.zoo.builtin import realtext
    from featcal.zoo.builtin.demo import needs_build

    if source == "smollm2" and source not in ready:  # the LLM zoo: tens of minutes on a CPU
        from featcal.zoo.builtin.smollm2 import needs_build as llm_needs_build

        if llm_needs_build():
            return True
        ready.add(source)
    if source not in (*NAMES, "real-text") or source in ready:
        return False
    if needs_build(NAMES[source]) if source in NAMES else realtext.needs_build():
        return True
    ready.add(source)
    return False


def build_zoo(source: str, on_step) -> None:
    """Build the built-in zoo ``source`` (a demo zoo, ``real-text``, the LLM zoo) into the cache,
    reporting its :class:`featcal.util.progress.Progress` to ``on_step`` (and bars to the server's
    terminal)."""
    from featcal.zoo import NAMES
    from featcal.zoo.builtin import realtext
    from featcal.zoo.builtin.demo import build_demo, demo_path

    if source == "smollm2":
        from featcal.zoo.builtin.smollm2 import ensure_built

        ensure_built(progress=True, on_step=on_step)
    elif source == "real-text":
        realtext.build_realtext(realtext.realtext_path(), progress=True, force=True, on_step=on_step)
    else:
        build_demo(demo_path(NAMES[source]), variant=NAMES[source], progress=True, on_step=on_step)


SMALL_MODEL = 20_000_000  # parameters: below this, one CPU thread is fastest


def cpu_threads(zoo, device: str, alone: bool = False) -> int:
    """Torch CPU threads for the app's work on ``zoo``: ``$FEATCAL_APP_THREADS`` if set;
    else every core for big models, and for work that has the machine to itself
    (``alone``: the exact run, which nothing runs beside until the preview's deadline);
    else 1 for small models on the CPU, whose work runs in pairs (output scores beside
    the drift): their ops are too small to split, so two one-thread jobs side by side beat
    two-thread jobs one after the other (measured: benchmarks/README.md, 'App latency');
    "every core" is those the load of other processes leaves free
    (:func:`featcal.util.threads.free_cores`, :func:`~featcal.util.threads.others_load`)."""
    from featcal.util.threads import free_cores, others_load, usable_cores

    env = os.environ.get("FEATCAL_APP_THREADS")
    if env:
        return max(1, int(env))
    if device == "cpu" and not alone and model_size(zoo.base)[0] < SMALL_MODEL:
        return 1
    return free_cores(usable_cores(), others_load())


def plain(text: str) -> str:
    """``text`` shown as it is inside a Markdown element (``st.error``): its Markdown and LaTeX
    characters escaped, so a path's ``__`` or ``$`` is not read as emphasis or maths; it wraps."""
    return re.sub(r"([\\`*_{}\[\]<>()#+|~$!])", r"\\\1", text)


def explain_load_error(source: str, exc: BaseException) -> str:
    """Markdown for the user: what went wrong loading ``source`` (the library's message whole, as
    wrapping text: a code block would cut it at the page's width) and what to do about that
    failure (one piece of advice, chosen by the kind of failure)."""
    msg = str(exc).strip() or type(exc).__name__
    kind = "" if isinstance(exc, FileNotFoundError) else f" ({type(exc).__name__})"
    lines = "  \n".join(plain(line) for line in msg.splitlines())
    return f"**Could not load zoo `{source}`{kind}.**\n\n{lines}\n\n{load_error_fix(source, exc)}"


def load_error_fix(source: str, exc: BaseException) -> str:
    """The one fix that matches ``exc``, the failure of loading ``source``."""
    from featcal.zoo.builtin.text_data import MissingPackagesError

    msg = str(exc).lower()
    path = Path(os.path.expandvars(source)).expanduser()
    if isinstance(exc, MissingPackagesError):
        return "Fix: install the packages listed above into the app's environment, then pick the zoo again."
    if isinstance(exc, ImportError):
        name = getattr(exc, "name", None) or "the missing package"
        return f"Fix: install `{name}` into the app's environment (`pip install {name}`), then reload the page."
    if isinstance(exc, FileNotFoundError) and "fix:" in msg:
        return "Fix: see the `fix:` lines above (the library lists every missing piece and how to get it)."
    if isinstance(exc, FileNotFoundError) and not path.exists():
        return (
            f"Fix: `{path}` does not exist: check the path, or pick a built-in zoo (`demo`, `real-text`) "
            "in the sidebar. *Your models* on the Zoo page writes a spec for your own models."
        )
    if path.suffix.lower() in (".yaml", ".yml"):
        return "Fix: correct the spec as the message says (every field is documented in docs/zoos.md)."
    if path.is_dir():
        return "Fix: give a zoo directory written by featcal (one holding meta.json), or a zoo spec YAML."
    return FIX_SPEC


def fingerprint(zoo, source: str) -> str:
    """Identifies the zoo's content: its recorded hash, else the spec file's bytes."""
    digest = zoo.meta.get("content_sha256")
    if digest:
        return str(digest)[:16]
    h = hashlib.sha256(source.encode())
    spec = zoo.meta.get("spec")
    if spec and Path(spec).is_file():
        h.update(Path(spec).read_bytes())
    return h.hexdigest()[:16]


def splits_of(zoo) -> list[str]:
    task = zoo.tasks[0]
    return list(zoo.data[task].splits)


def split_size(zoo, split: str) -> int:
    """The smallest size of ``split`` over the tasks."""
    return min(len(zoo.split(t, split)[1]) for t in zoo.tasks)


def model_size(model: nn.Module) -> tuple[int, int]:
    """``(parameters, bytes)`` of a model. *Belongs in featcal* (``featcal.model.arch``)."""
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(b.numel() * b.element_size() for b in model.buffers())
    return params, nbytes


def zoo_models(zoo) -> pd.DataFrame:
    """One row per model of the zoo (its own merged model too, when it has one): role, task,
    parameters, MB. *Belongs in featcal.zoo*."""
    rows = []
    given = [("your merged model", "", zoo.given_merged)] if zoo.given_merged is not None else []
    for role, task, m in [("base", "", zoo.base), *(("expert", t, m) for t, m in zoo.experts.items()), *given]:
        params, nbytes = model_size(m)
        rows.append(
            {
                "role": role,
                "task": task,
                "class": type(m).__name__,
                "parameters": params,
                "MB": round(nbytes / 2**20, 2),
            }
        )
    return pd.DataFrame(rows)


def zoo_tasks(zoo) -> pd.DataFrame:
    """One row per task: its classes (a generative zoo's: its scorer, :meth:`featcal.zoo.Zoo.task_facts`)
    and split sizes."""
    return pd.DataFrame(
        [
            {"task": t, **zoo.task_facts(t), **{s: len(zoo.split(t, s)[1]) for s in zoo.data[t].splits}}
            for t in zoo.tasks
        ]
    )
