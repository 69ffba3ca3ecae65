"""The repository's layers, read from the source with ``ast`` (nothing is imported).

- the library (``featcal/``, ``diagnostics/``) never imports the app (``app/``);
- ``featcal/`` imports ``diagnostics/`` only in its command-line table (:data:`CLI_TABLE`);
- the module import graph has no cycle;
- featcal's folders import one way, lower to higher (:data:`FOLDER_LAYERS`): util and config <- model
  <- method <- engine <- baselines, streaming <- sweep, zoo <- reproduce <- cli, and the package's ``__init__`` on top;
- the zoo's modules import one way: schema <- locate <- load <- build (:data:`ZOO_LAYERS`);
- no tracked file points outside the repository (to a ``shared`` folder beside it).

Every import counts: those inside functions too (an import moved into a function to
dodge a cycle is still a cycle), ``importlib.import_module("...")`` with a literal name,
and package-relative ones. Only imports under ``if TYPE_CHECKING:`` are skipped (they
never run). ``import featcal`` / ``from featcal import X`` (X not a module) is an edge to
the package's ``__init__``, named ``featcal``.

Run it as a command to print what it finds:

    python -m tests.repo.test_layers
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("featcal", "diagnostics", "app")
LIBRARY = ("featcal", "diagnostics")
CLI_TABLE = "featcal.cli.commands"  # the one featcal module allowed to import diagnostics
OUTSIDE = "../" + "shared"  # spelled in two parts so this file does not match itself
# featcal's folders, lowest first: a module may import its own layer and those before it.
FOLDER_LAYERS = {
    "base": ("featcal.config", "featcal.util"),
    "model": ("featcal.model",),
    "method": ("featcal.method",),
    "engine": ("featcal.engine",),
    "baselines, streaming": ("featcal.baselines", "featcal.streaming"),
    "sweep, zoo": ("featcal.sweep", "featcal.zoo"),
    "reproduce": ("featcal.reproduce",),
    "cli": ("featcal.cli", "featcal.__main__"),
    "package": ("featcal",),
}
# featcal.zoo's layers, lowest first: a module may import its own layer and those before it.
ZOO_LAYERS = {
    "base": (
        # the folders' __init__ modules only name their modules; they import nothing
        "featcal.zoo.spec",
        "featcal.zoo.load",
        "featcal.zoo.score",
        "featcal.zoo.formats",
        "featcal.zoo.builtin",
        "featcal.zoo.core",
        "featcal.zoo.io",
        "featcal.zoo.load.classnames",
        "featcal.zoo.builtin.demo_data",
        "featcal.zoo.spec.resolve",
        "featcal.zoo.tokens",
        "featcal.zoo.score.sandbox",  # runs generated code in a confined child process
        "featcal.zoo.score.sandbox_child",  # the code that child runs (stdlib only)
        "featcal.zoo.score.ifeval",  # IFEval's instruction checks
        "featcal.zoo.score.replies",  # scorers of generated replies, by name
    ),
    "schema": ("featcal.zoo.spec.schema", "featcal.zoo.spec.parsing", "featcal.zoo.spec.generative"),
    "locate": ("featcal.zoo.spec.locate",),
    "load": (
        "featcal.zoo.spec.userspec",  # writes a spec from the user's folders (the app's "Your models")
        "featcal.zoo.load.loaders",
        "featcal.zoo.load.heads",
        "featcal.zoo.load.data",
        "featcal.zoo.load.text",  # a spec's text zoo: encoders, tokenizer, text and token files
        "featcal.zoo.load.from_spec",
        "featcal.zoo.store",
        "featcal.zoo.score.scores",
        "featcal.zoo.formats.fusionbench",
        "featcal.zoo.builtin.text_data",  # reads WordNet for the LLM zoo's tasks too
        "featcal.zoo.builtin.llm_tasks",
        "featcal.zoo.score.lm",
        "featcal.zoo.score.harness",  # lm-eval-harness on a language model held in memory
        "featcal.zoo.score.scorers",  # what a generative zoo's task is scored with, by name
        "featcal.zoo.score.seq2seq",  # encoder-decoder zoos (FLAN-T5 on GLUE as text)
        "featcal.zoo.load.generative",  # a spec's causal_lm / seq2seq zoo: models, tokenizer, examples
        "featcal.zoo.load.lm_dir",  # an LLM zoo's directory: its spec and tables (the built-in smollm2)
        "featcal.zoo.formats.lm_pools",  # FusionBench's Seq2SeqLMPool / CausalLMPool as specs
    ),
    "build": (
        "featcal.zoo.builtin.demo_recipe",
        "featcal.zoo.builtin.fashion",
        "featcal.zoo.builtin.demo",
        "featcal.zoo.builtin.realtext",
        "featcal.zoo.builtin.smollm2",
    ),
    "package": ("featcal.zoo",),
}


# ----------------------------------------------------------------------------- the graph


def repo_modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: path}`` of every .py file under :data:`PACKAGES`
    (a package's ``__init__.py`` is named after the package)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every module name ``tree`` imports, absolute; a ``from X import a`` gives ``X.a``
    (resolved later to ``X.a`` if that is a module, else ``X``)."""
    names: list[str] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names.extend(f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)
        elif isinstance(node, ast.Call) and _literal_import(node):
            names.append(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _literal_import(call: ast.Call) -> bool:
    """``importlib.import_module("x")`` or ``__import__("x")`` with a literal name."""
    fn = call.func
    named = (isinstance(fn, ast.Attribute) and fn.attr == "import_module") or (
        isinstance(fn, ast.Name) and fn.id in ("import_module", "__import__")
    )
    return named and bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The repository module ``name`` refers to: itself, else its longest known prefix
    (``featcal.zoo.load_any`` -> ``featcal.zoo``); None outside the repository."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: {repository modules it imports}}`` (self-imports left out)."""
    known = repo_modules(root)
    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = {_resolve(n, known) for n in _import_names(tree, module, path.name == "__init__.py")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted:
    every module of one imports every other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _in(module: str, packages: tuple[str, ...] | str) -> bool:
    packages = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in packages)


def library_imports_of_app(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every library module importing the app."""
    return [f"{m} -> {t}" for m in sorted(graph) if _in(m, LIBRARY) for t in sorted(graph[m]) if _in(t, "app")]


def featcal_imports_of_diagnostics(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every featcal module but :data:`CLI_TABLE` importing diagnostics."""
    return [
        f"{m} -> {t}"
        for m in sorted(graph)
        if _in(m, "featcal") and m != CLI_TABLE
        for t in sorted(graph[m])
        if _in(t, "diagnostics")
    ]


def folder_layer(module: str) -> str | None:
    """The :data:`FOLDER_LAYERS` layer of a featcal module (its longest listed prefix; ``featcal`` itself
    names only the package's ``__init__``), None where no layer lists it."""
    best, found = -1, None
    for layer, prefixes in FOLDER_LAYERS.items():
        for prefix in prefixes:
            listed = module == prefix or (prefix != "featcal" and module.startswith(prefix + "."))
            if listed and len(prefix) > best:
                best, found = len(prefix), layer
    return found


def folder_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"importer (layer) -> imported (later layer)"`` for every featcal import against
    :data:`FOLDER_LAYERS`, and ``"module: in no layer"`` for a featcal module outside them all."""
    names = list(FOLDER_LAYERS)
    out = [f"{m}: in no layer of FOLDER_LAYERS" for m in sorted(graph) if _in(m, "featcal") and not folder_layer(m)]
    for m in sorted(graph):
        lm = folder_layer(m)
        for t in sorted(graph[m]):
            lt = folder_layer(t)
            if lm and lt and names.index(lt) > names.index(lm):
                out.append(f"{m} ({lm}) -> {t} ({lt})")
    return out


def zoo_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"importer (layer) -> imported (later layer)"`` for every zoo import against :data:`ZOO_LAYERS`,
    and ``"module: in no layer"`` for a zoo module not placed in one."""
    rank = {m: i for i, modules in enumerate(ZOO_LAYERS.values()) for m in modules}
    names = list(ZOO_LAYERS)
    out = [f"{m}: in no layer of ZOO_LAYERS" for m in sorted(graph) if _in(m, "featcal.zoo") and m not in rank]
    for m in sorted(graph):
        for t in sorted(graph[m]):
            if m in rank and t in rank and rank[t] > rank[m]:
                out.append(f"{m} ({names[rank[m]]}) -> {t} ({names[rank[t]]})")
    return out


def files_pointing_outside(root: Path = ROOT) -> list[str] | None:
    """Tracked files containing :data:`OUTSIDE` (None when git cannot list them)."""
    git = shutil.which("git")
    if git is None:
        return None
    proc = subprocess.run([git, "ls-files", "-z"], cwd=root, capture_output=True)
    if proc.returncode != 0:
        return None
    needle = OUTSIDE.encode()
    out = []
    for name in filter(None, proc.stdout.decode().split("\0")):
        path = root / name
        if path.is_file() and needle in path.read_bytes():
            out.append(name)
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Function-level, relative and importlib imports are edges; TYPE_CHECKING ones are not."""
    pkg = tmp_path / "featcal"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "diagnostics").mkdir()
    (tmp_path / "app").mkdir()
    (pkg / "__init__.py").write_text("from featcal.a import f\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from featcal import b\n"
        "def f():\n    from . import b\n"
    )
    (pkg / "b.py").write_text("import importlib\ndef g():\n    importlib.import_module('featcal.sub.c')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom featcal import f\n")
    g = import_graph(tmp_path)
    assert g["featcal"] == {"featcal.a"} and g["featcal.a"] == {"featcal.b"}
    assert g["featcal.b"] == {"featcal.sub.c"} and g["featcal.sub.c"] == {"featcal.a", "featcal"}
    assert cycles(g) == [["featcal", "featcal.a", "featcal.b", "featcal.sub.c"]]
    (pkg / "sub" / "c.py").write_text("import numpy\n")
    assert cycles(import_graph(tmp_path)) == []


def test_zoo_layers_catch_an_upward_import_and_an_unplaced_module():
    g = {
        "featcal.zoo.spec.schema": {"featcal.zoo.load.loaders"},
        "featcal.zoo.load.loaders": {"featcal.zoo.spec.schema"},
        "featcal.zoo.extra": set(),
    }
    assert zoo_layer_violations(g) == [
        "featcal.zoo.extra: in no layer of ZOO_LAYERS",
        "featcal.zoo.spec.schema (schema) -> featcal.zoo.load.loaders (load)",
    ]


def test_folder_layers_catch_an_upward_import():
    g = {
        "featcal.method.solve": {"featcal.engine.run", "featcal.model.arch", "featcal.config"},
        "featcal.engine.run": {"featcal.method.solve"},
        "featcal.stray": set(),
    }
    assert folder_layer_violations(g) == [
        "featcal.stray: in no layer of FOLDER_LAYERS",
        "featcal.method.solve (method) -> featcal.engine.run (engine)",
    ]


def test_featcal_folders_import_one_way(graph):
    bad = folder_layer_violations(graph)
    assert not bad, f"an import against featcal's folder layers (FOLDER_LAYERS, lowest first): {bad}"


def test_library_never_imports_the_app(graph):
    bad = library_imports_of_app(graph)
    assert not bad, f"featcal/ and diagnostics/ must not import app/ (the app is a view over them): {bad}"


def test_featcal_imports_diagnostics_only_in_its_command_table(graph):
    bad = featcal_imports_of_diagnostics(graph)
    assert not bad, (
        f"featcal/ may import diagnostics/ only in {CLI_TABLE} (the table of subcommands "
        f"includes `diagnose`); found {bad}"
    )


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (each list: modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_zoo_imports_one_way(graph):
    bad = zoo_layer_violations(graph)
    assert not bad, f"featcal.zoo imports against its layers {list(ZOO_LAYERS)}: {bad}"


def test_no_tracked_file_points_outside_the_repository():
    bad = files_pointing_outside()
    if bad is None:
        pytest.skip("git is not available to list the tracked files")
    assert not bad, f"these tracked files cite {OUTSIDE!r}, which is not part of the repository: {bad}"


# ----------------------------------------------------------------------------- as a command


def main() -> int:
    """Print every finding; exit status 1 when there is one."""
    g = import_graph()
    found = cycles(g)
    problems = [
        ("import cycles", [" <-> ".join(c) for c in found]),
        ("library modules importing the app", library_imports_of_app(g)),
        (f"featcal modules other than {CLI_TABLE} importing diagnostics", featcal_imports_of_diagnostics(g)),
        ("featcal imports against its folder layers", folder_layer_violations(g)),
        ("zoo imports against its layers", zoo_layer_violations(g)),
        (f"tracked files citing {OUTSIDE!r}", files_pointing_outside() or []),
    ]
    print(f"{len(g)} modules, {sum(len(t) for t in g.values())} imports between them")
    for title, items in problems:
        print(f"{title}: {len(items) or 'none'}")
        for item in items:
            print(f"  {item}")
    return int(any(items for _, items in problems))


if __name__ == "__main__":
    sys.exit(main())
