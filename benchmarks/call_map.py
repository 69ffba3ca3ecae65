"""Which featcal modules one ``calibrate()`` call passes through, and how many code lines they hold:
what a newcomer must read to follow one call (issue 37's measure of readability).

    .venv/bin/python benchmarks/call_map.py [--variant plain|keep_stats|expert_trace|all]

A profile hook records every Python function entered during the call; the modules are the
``featcal/`` files those functions belong to (generated ones such as a dataclass's ``__init__``
count for the module that defines the class). Code lines are the file's lines less blank lines,
comment lines and docstrings (a module's, a class's, a function's). The call is the README's with
16 examples per task where the README has 64, to stay quick: the demo zoo, Task Arithmetic 0.3,
the CLIP preset.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: not blank, not only a comment, not part of a docstring."""
    text = path.read_text(encoding="utf-8")
    doc = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.ENDMARKER:
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc)


def modules_of_call(fn) -> set[Path]:
    """The ``featcal/`` files whose functions run while ``fn()`` runs."""
    package = ROOT / "featcal"
    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call":  # the module whose globals the code runs in: dataclasses' __init__ included
            seen.add(frame.f_globals.get("__file__") or frame.f_code.co_filename)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {Path(f) for f in seen if Path(f).resolve().is_relative_to(package)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="all", choices=["plain", "keep_stats", "expert_trace", "all"])
    args = parser.parse_args()

    from featcal import ExpertTrace, FeatCalConfig, calibrate, merge_model
    from featcal.zoo import load_demo

    zoo = load_demo(progress=False)
    merged = merge_model("task_arithmetic", zoo.base, zoo.experts, scale=0.3)
    data = zoo.calib_data(16, seed=42)
    common = dict(base=zoo.base, experts=zoo.experts, calib_data=data, config=FeatCalConfig.clip(), progress=False)
    calibrate(merged, **common)  # imports and first-call set-up out of the way
    variants = {
        "plain": lambda: calibrate(merged, **common),
        "keep_stats": lambda: calibrate(merged, keep_stats=True, **common),
        "expert_trace": lambda: calibrate(merged, expert_trace=ExpertTrace(), **common),
    }
    chosen = list(variants) if args.variant == "all" else [args.variant]
    rows = []
    for name in chosen:
        files = sorted(modules_of_call(variants[name]))
        per_file = {f.resolve().relative_to(ROOT).as_posix(): code_lines(f) for f in files}
        rows.append((name, per_file))
    print("| call | modules | code lines | total lines |")
    print("|---|---:|---:|---:|")
    for name, per_file in rows:
        total = sum(len((ROOT / f).read_text().splitlines()) for f in per_file)
        print(f"| {name} | {len(per_file)} | {sum(per_file.values())} | {total} |")
    print()
    for name, per_file in rows:
        print(f"{name}: " + ", ".join(f"{f} ({n})" for f, n in per_file.items()))


if __name__ == "__main__":
    main()
