"""``featcal zoo``: build the built-in zoos, say where a zoo is and what it holds, and write a spec of a
FusionBench model pool (``zoo from-fusionbench``, :mod:`featcal.cli.formats`).

    featcal zoo build-demo [--variant default|fashion] [--rebuild]
    featcal zoo build real-text [--rebuild]
    featcal zoo info --zoo demo
"""

from __future__ import annotations

import argparse
import datetime as _dt
import time

from featcal.cli.common import add_zoo
from featcal.cli.formats import add_from_fusionbench, run_from_fusionbench
from featcal.zoo import BUILT, NAMES, load_any, load_demo

BUILTIN = (*NAMES, *BUILT)  # the zoos `featcal zoo build NAME` makes


def add_zoo_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="zoo_command", required=True, metavar="{build,build-demo,info,from-fusionbench}")
    b = sub.add_parser("build-demo", help="build (or rebuild) the embedded demo zoo in the cache")
    b.add_argument("--variant", default="default", choices=("default", "fashion"))
    b.add_argument("--rebuild", action="store_true", help="build afresh even if cached")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    n = sub.add_parser("build", help="build (or rebuild) a built-in zoo in the cache: " + ", ".join(BUILTIN))
    n.add_argument("name", choices=BUILTIN, help="the zoo")
    n.add_argument("--rebuild", action="store_true", help="build afresh even if cached")
    n.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="where a zoo is and what it holds")
    add_zoo(i)
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    add_from_fusionbench(sub)


def run_zoo(args) -> int:
    started = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    t0 = time.perf_counter()
    if args.zoo_command == "from-fusionbench":
        return run_from_fusionbench(args)
    if args.zoo_command == "build-demo":
        zoo = load_demo(rebuild=args.rebuild, progress=not args.quiet, variant=args.variant)
    elif args.zoo_command == "build":
        zoo = load_any(args.name, progress=not args.quiet, rebuild=args.rebuild)
    else:
        zoo = load_any(args.zoo, progress=not args.quiet)
    _print_zoo_info(zoo, time.perf_counter() - t0, built_now=_built_since(zoo.meta, started))
    return 0


def _built_since(meta: dict, started: _dt.datetime) -> bool:
    """Whether the zoo was built by this command (its ``built_at`` is not before ``started``)."""
    built_at = meta.get("built_at")
    return built_at is not None and _dt.datetime.fromisoformat(built_at) >= started


def _print_zoo_info(zoo, seconds: float, built_now: bool = False) -> None:
    meta = zoo.meta
    print(f"zoo {zoo.name}: {len(zoo.tasks)} tasks, format {zoo.fmt}")
    if "path" in meta:
        print(f"  path          {meta['path']}")
    if "disk_bytes" in meta:
        print(f"  disk          {meta['disk_bytes'] / 1e6:.1f} MB")
    if "build_seconds" in meta and not built_now:
        print(f"  built in      {meta['build_seconds']:.0f} s ({meta.get('built_at', '?')})")
    if "content_sha256" in meta:
        print(f"  sha256        {meta['content_sha256']}")
    print(f"  {'built' if built_now else 'loaded'} in     {seconds:.1f} s")
    for task in zoo.tasks:
        sizes = ", ".join(f"{s} {len(zoo.split(task, s)[1])}" for s in zoo.data[task].splits)
        facts = ", ".join(f"{k} {v}" for k, v in zoo.task_facts(task).items() if v is not None)
        print(f"  {task:14s}{facts}  ({sizes})")
