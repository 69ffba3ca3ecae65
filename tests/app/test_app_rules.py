"""The app's structural rules (issue 37), read from the source: pages draw and never take a
lock; no page function reads a page global assigned further down the script; no module of
the app mutates a module-level container (server-wide state belongs to
:class:`app.calibrations.Calibrations`)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
PAGES = sorted((APP / "pages").glob("*.py"))
MUTATORS = {"pop", "popitem", "update", "clear", "setdefault", "append", "add", "discard", "remove", "move_to_end"}
CONTAINERS = {"dict", "OrderedDict", "defaultdict", "Counter", "set", "list"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module_assignments(tree: ast.Module) -> dict[str, int]:
    """Module-level name -> the line of its first binding (assignment, for, with)."""
    first: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                first.setdefault(sub.id, sub.lineno)
    return first


def _late_reads(path: Path) -> list[str]:
    tree = _tree(path)
    first = _module_assignments(tree)
    out = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        args = fn.args
        local = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
                if first.get(n.id, 0) > fn.lineno:
                    out.append(f"{path.name}:{n.lineno} {fn.name} reads {n.id} (assigned on line {first[n.id]})")
    return out


def test_no_page_function_reads_a_global_assigned_further_down():
    late = [msg for page in PAGES for msg in _late_reads(page)]
    assert not late, late


def test_pages_never_take_a_lock():
    found = []
    for page in PAGES:
        for node in ast.walk(_tree(page)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
            if {"lock", "locked", "acquire"} & set(name.lower().split("_")) or name in ("shared", "scratch"):
                found.append(f"{page.name}:{node.lineno} {name}")
    assert not found, found


def _module_containers(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            made = isinstance(value, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp))
            if isinstance(value, ast.Call):
                func = value.func
                made = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in CONTAINERS
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name) and made}
    return names


def test_no_app_module_mutates_a_module_level_container():
    found = []
    for path in sorted(p for p in APP.rglob("*.py") if p.parent.name != "pages"):  # a page's globals: one run
        tree = _tree(path)
        containers = _module_containers(tree)
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target = node.func.value
            if isinstance(target, ast.Name) and target.id in containers:
                found.append(f"{path.name}:{node.lineno} {target.id}")
    assert not found, found
