"""The flat layout's import names still work for one release, each with a DeprecationWarning."""

import importlib
import sys

import pytest

from featcal._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_is_the_new_module_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new
    assert new.__spec__.name == MOVED[old]  # the alias did not take over the module's own spec


@pytest.mark.parametrize(
    ("package", "name", "target"),
    [
        ("featcal.engine", "calibrate", "featcal.engine.run"),
        ("featcal.streaming", "calibrate_checkpoints", "featcal.streaming.run"),
        ("featcal.cli", "main", "featcal.cli.commands"),
        ("featcal.model.checkpoints", "skeleton", "featcal.model.skeletons"),
        ("featcal.model.checkpoints", "release", "featcal.model.skeletons"),
        ("featcal.zoo.schema", "parse", "featcal.zoo.parsing"),
        ("featcal.zoo.schema", "from_dict", "featcal.zoo.parsing"),
    ],
)
def test_the_names_an_old_module_held_still_work_from_it(package, name, target):
    pkg = importlib.import_module(package)
    pkg.__dict__.pop(name, None)
    with pytest.warns(DeprecationWarning, match=f"{package}.{name} moved to {target}.{name}"):
        value = getattr(pkg, name)
    assert value is getattr(importlib.import_module(target), name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pkg.no_such_name


@pytest.mark.parametrize("module", ["featcal.cli.calibrate", "featcal.cli.evaluate", "featcal.engine.run"])
def test_a_package_module_imported_first_finds_its_sibling_modules(module):
    """``from featcal.cli import ranks`` inside the package is the submodule, not an old name
    looked up in the flat module's successor (which would import it half-way: a circular import)."""
    import subprocess

    code = f"import {module}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
