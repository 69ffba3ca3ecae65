"""Files past 450 lines and functions past 60 lines of code (docstrings not counted) in the library,
the diagnostics and the app: the places a reader may find too long. Run from the repository root:

    python scripts/code_sizes.py [--files 450] [--functions 60] [--check]

With ``--check`` it exits 1 when any place is long (``tests/repo/test_sizes.py`` holds the code to
the limits). Data are not code: long lists (the CLIP class names) live in data files under the
package, not in a ``.py`` file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("featcal", "diagnostics", "app")
FILE_LIMIT = 450
FUNCTION_LIMIT = 60


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def long_places(root: Path = ROOT, file_limit: int = FILE_LIMIT, function_limit: int = FUNCTION_LIMIT) -> list[str]:
    """One line per file over ``file_limit`` lines and per function over ``function_limit`` lines of
    code (its docstring not counted)."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=FILE_LIMIT, help="file length limit (lines)")
    ap.add_argument("--functions", type=int, default=FUNCTION_LIMIT, help="function length limit (lines of code)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a place is past the limits")
    args = ap.parse_args()
    found = long_places(file_limit=args.files, function_limit=args.functions)
    print("\n".join(found) if found else "none")
    if args.check and found:
        sys.exit(1)


if __name__ == "__main__":
    main()
