"""Old import paths of the flat layout (before the folders), kept working for one release.

``import featcal.solve`` gives :mod:`featcal.method.solve` itself (same module object, so monkeypatching
either name patches both) with a ``DeprecationWarning``; the three old modules that became packages
(``featcal.engine``, ``featcal.streaming``, ``featcal.cli``) resolve their old names through
:func:`moved_attribute`. README.md's Layout section says what moved where.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "featcal.progress": "featcal.util.progress",
    "featcal.threads": "featcal.util.threads",
    "featcal.metrics": "featcal.util.metrics",
    "featcal.arch": "featcal.model.arch",
    "featcal.capture": "featcal.model.capture",
    "featcal.streams": "featcal.model.streams",
    "featcal.modes": "featcal.model.modes",
    "featcal.validate": "featcal.model.validate",
    "featcal.sources": "featcal.model.loading",
    "featcal.checkpoints": "featcal.model.checkpoints",
    "featcal.reference": "featcal.method.reference",
    "featcal.stats": "featcal.method.stats",
    "featcal.solve": "featcal.method.solve",
    "featcal.blockstats": "featcal.engine.blockstats",
    "featcal.trace": "featcal.engine.trace",
    "featcal.preview": "featcal.engine.preview",
    "featcal.report": "featcal.engine.report",
    "featcal.blocksource": "featcal.engine.blocksource",
    "featcal.merging": "featcal.baselines.merging",
    "featcal.merging_spectral": "featcal.baselines.spectral",
    "featcal.regmean": "featcal.baselines.regmean",
    "featcal.calibrators": "featcal.baselines.trained.calibrators",
    "featcal.calibrator_modules": "featcal.baselines.trained.modules",
    "featcal.calibrator_training": "featcal.baselines.trained.training",
    "featcal.tune": "featcal.sweep.search",
    "featcal.tune_jobs": "featcal.sweep.jobs",
    "featcal.studies": "featcal.sweep.studies",
    "featcal.corrupt": "featcal.sweep.corrupt",
    "featcal.tune_figures": "featcal.sweep.figures",
    "featcal.cli_common": "featcal.cli.common",
    "featcal.tune_cli": "featcal.cli.sweep",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the new module object."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name], stacklevel=8)
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system set the alias's spec on the shared module object; give it its own back
        module.__spec__ = self._own_spec


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.append(_Alias())


def moved_attribute(package: str, target: str):
    """A module ``__getattr__`` for a package that replaced the flat module of the same name:
    ``featcal.engine.calibrate`` -> ``featcal.engine.run.calibrate``, with a warning; or for a
    module some of whose names moved to ``target``. A name that is a submodule of ``package`` is
    left to the import system (``from featcal.cli import ranks`` inside the package must not
    import ``target`` half-way through the package's own imports)."""

    def _submodule(name: str) -> bool:
        return hasattr(sys.modules[package], "__path__") and importlib.util.find_spec(f"{package}.{name}") is not None

    def __getattr__(name: str):
        if not name.startswith("__") and not _submodule(name):
            module = importlib.import_module(target)
            if hasattr(module, name):
                _warn(f"{package}.{name}", f"{target}.{name}", stacklevel=3)
                value = getattr(module, name)
                setattr(sys.modules[package], name, value)  # warned once; later look-ups find it
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
