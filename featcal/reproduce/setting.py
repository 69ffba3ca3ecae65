"""Which zoo a reproduction runs on, and whether it is the paper's setting, told before any model loads.

A zoo is named as ``featcal reproduce --zoo`` takes it: a built-in name (``demo``, ``demo-fashion``,
``real-text``, ``smollm2``), the name of a spec shipped under assets/zoos/ (``clip-vit-b32-ta8``), a
YAML spec (featcal's or a FusionBench model pool) or a zoo directory. :func:`zoo_identity` reads
what it declares (name, base model's hub id, tasks) from the spec or the directory's meta.json,
loading nothing; :func:`setting_problems` compares that with a table's :class:`~featcal.reproduce.tables.Setting`:

- the tasks must be the table's (as a set), or as many where the table does not name them;
- the base model's hub id must be the table's; a spec whose base is a local path passes on its task
  names alone (featcal cannot tell which model a folder holds), and nothing passes on a count alone;
- a built-in zoo is never a paper setting.

An empty list means the zoo is the table's setting; otherwise ``featcal reproduce`` refuses unless
``--any-zoo`` is given, and then says the numbers are not comparable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from featcal.reproduce.tables import Setting
from featcal.zoo import BUILT, NAMES
from featcal.zoo.builtin.demo import SHIPPED
from featcal.zoo.formats import fusionbench
from featcal.zoo.spec.parsing import parse

SHIPPED_SPECS = SHIPPED.parent  # assets/zoos/: the paper settings' specs


@dataclass(frozen=True)
class ZooIdentity:
    """What a zoo declares: ``name``, its base model's hub ``model`` id (None: a local path or a
    built-in zoo), its ``tasks`` (None when not declared), and whether it is ``builtin``."""

    name: str
    model: str | None
    tasks: tuple[str, ...] | None
    builtin: bool = False


def resolve_zoo(zoo: str) -> str:
    """The path or built-in name ``zoo`` stands for: a shipped spec's name (``clip-vit-b32-ta8``)
    becomes its file under assets/zoos/; anything else is returned as given. A shipped name whose
    spec is not in this checkout is a ``FileNotFoundError`` naming the file."""
    if zoo in NAMES or zoo in BUILT:
        return zoo
    path = Path(os.path.expandvars(zoo)).expanduser()
    if path.exists() or path.suffix.lower() in (".yaml", ".yml") or os.sep in zoo:
        return zoo
    shipped = SHIPPED_SPECS / f"{zoo}.yaml"
    if shipped.is_file():
        return str(shipped)
    raise FileNotFoundError(
        f"zoo {zoo!r}: no such file, built-in zoo or shipped spec ({shipped} is not in this checkout); "
        f"give a YAML spec, a zoo directory or one of {', '.join([*NAMES, *BUILT])}."
    )


def zoo_identity(zoo: str) -> ZooIdentity:
    """What the zoo named ``zoo`` (after :func:`resolve_zoo`) declares, read without loading a model."""
    if zoo in NAMES or zoo in BUILT:
        return ZooIdentity(zoo, None, None, builtin=True)
    path = Path(os.path.expandvars(zoo)).expanduser()
    if path.suffix.lower() in (".yaml", ".yml"):
        spec = fusionbench.pool_spec(path) if fusionbench.is_pool(path) else parse(path)
        return ZooIdentity(spec.name, spec.base.id if not spec.base.path else None, tuple(spec.tasks))
    meta = path / "meta.json"
    if not meta.is_file():
        raise FileNotFoundError(f"zoo {zoo!r}: not a YAML spec and no meta.json in it; give a spec or a zoo directory.")
    info = json.loads(meta.read_text(encoding="utf-8"))
    tasks = info.get("tasks")
    return ZooIdentity(str(info.get("name", path.name)), None, tuple(tasks) if tasks else None)


def setting_problems(setting: Setting, zoo: ZooIdentity) -> list[str]:
    """Why ``zoo`` is not ``setting`` (one sentence each; empty: it is)."""
    if zoo.builtin:
        return [f"{zoo.name!r} is a built-in zoo, not the paper's {setting.model} setting"]
    out = []
    if zoo.tasks is None:
        out.append(f"zoo {zoo.name!r} does not declare its tasks")
    elif setting.tasks is not None and set(zoo.tasks) != set(setting.tasks):
        missing = sorted(set(setting.tasks) - set(zoo.tasks))
        extra = sorted(set(zoo.tasks) - set(setting.tasks))
        out.append(f"its tasks are not the table's (missing {missing or 'none'}, extra {extra or 'none'})")
    elif len(zoo.tasks) != setting.n_tasks:
        out.append(f"it has {len(zoo.tasks)} tasks, the table {setting.n_tasks}")
    if zoo.model is not None and zoo.model.lower() != setting.model.lower():
        out.append(f"its base model is {zoo.model}, the table's {setting.model}")
    elif zoo.model is None and setting.tasks is None and not out:
        out.append(f"its base model is a local path: featcal cannot tell it is {setting.model}")
    return out
