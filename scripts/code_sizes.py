"""Files past 450 lines and functions past 60 lines of code (docstrings not counted) in the library
and the app: the places a reader may find too long. Run from the repository root:

    python scripts/code_sizes.py [--files 450] [--functions 60]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("featcal", "diagnostics", "app")


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def long_places(root: Path = ROOT, file_limit: int = 450, function_limit: int = 60) -> list[str]:
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
    ap.add_argument("--files", type=int, default=450, help="file length limit (lines)")
    ap.add_argument("--functions", type=int, default=60, help="function length limit (lines of code)")
    args = ap.parse_args()
    found = long_places(file_limit=args.files, function_limit=args.functions)
    print("\n".join(found) if found else "none")


if __name__ == "__main__":
    main()
