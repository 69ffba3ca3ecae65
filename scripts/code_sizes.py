"""Files past 450 lines and functions past 60 lines of code (docstrings not counted) in the library
and the app: the places a reader may find too long. Run from the repository root:

    python scripts/code_sizes.py [--files 450] [--functions 60]

The few places long on purpose are in :data:`ALLOWED`, each with its reason; they are printed
apart (``allowed: ...``), so that a new long place is never hidden among them.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("featcal", "diagnostics", "app")
# Files or functions (as ``path`` or ``path:function``) allowed past the limits, and why.
ALLOWED = {
    "featcal/zoo/classnames.py": "pure data: the class names and prompt templates of the eight CLIP tasks, "
    "one name per line as the datasets list them; three small functions, nothing to split",
}


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def long_places(root: Path = ROOT, file_limit: int = 450, function_limit: int = 60) -> list[str]:
    """One line per file over ``file_limit`` lines and per function over ``function_limit`` lines of
    code (its docstring not counted), :data:`ALLOWED` ones included."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(root)
            n = text.count("\n")
            if n > file_limit:
                out.append(f"file {rel}: {n} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                    if length > function_limit:
                        out.append(f"function {rel}:{node.lineno} {node.name}: {length} lines")
    return out


def allowed_reason(place: str) -> str | None:
    """Why ``place`` (a line of :func:`long_places`) may stay long, or None when it may not."""
    kind, rest = place.split(" ", 1)
    path = rest.split(":", 1)[0]
    key = path if kind == "file" else f"{path}:{rest.split(' ')[1]}"
    return ALLOWED.get(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=450, help="file length limit (lines)")
    ap.add_argument("--functions", type=int, default=60, help="function length limit (lines of code)")
    args = ap.parse_args()
    found = long_places(file_limit=args.files, function_limit=args.functions)
    long = [p for p in found if allowed_reason(p) is None]
    print("\n".join(long) if long else "none")
    for place in found:
        if allowed_reason(place) is not None:
            print(f"allowed: {place} ({allowed_reason(place)})")


if __name__ == "__main__":
    main()
