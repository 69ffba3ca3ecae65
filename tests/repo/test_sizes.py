"""The size limits of the style guide, held: no file in featcal/, diagnostics/ or app/ past 450
lines, no function past 60 lines of code (``scripts/code_sizes.py`` counts them). Data are not
code: they live in data files under the package, and every such file ships (is listed in
pyproject.toml's package-data).
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_sizes():
    spec = importlib.util.spec_from_file_location("code_sizes", ROOT / "scripts" / "code_sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_file_or_function_past_the_limits():
    sizes = _code_sizes()
    long = sizes.long_places(ROOT, file_limit=450, function_limit=60)
    for place in long:
        print(place)
    assert not long, f"past {sizes.FILE_LIMIT} lines a file or {sizes.FUNCTION_LIMIT} a function:\n" + "\n".join(long)


def test_the_package_data_files_ship():
    """Every file under featcal/ that is not Python is matched by a package-data pattern, so that
    ``pip install`` copies it."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = table["tool"]["setuptools"]["package-data"]
    shipped = {
        path
        for package, globs in patterns.items()
        for glob in globs
        for path in (ROOT / package.replace(".", "/")).glob(glob)
    }
    data = {
        path
        for path in (ROOT / "featcal").rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }
    assert data, "expected data files under featcal/ (the CLIP class names)"
    assert data <= shipped, f"not in pyproject.toml's package-data: {sorted(map(str, data - shipped))}"
