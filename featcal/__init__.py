"""featcal: post-merging feature calibration (FeatCal) and feature-drift diagnostics.

Usage::

    from featcal import FeatCalConfig, calibrate, merge_model
    merged = merge_model("task_arithmetic", base, experts, scale=0.3)  # a model; merge() gives a state dict
    model, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig.clip())
"""

import importlib

__version__ = "0.1.0"

# Where each name of the package lives: imported on first use (PEP 562), so that `import featcal`, and
# with it `featcal --help` and the launcher of `featcal app`, does not import torch.
_LAZY = {
    "FeatCalConfig": "featcal.config",
    "FastPaths": "featcal.config",
    "Setting": "featcal.config",
    "TokenWeights": "featcal.config",
    "calibrate": "featcal.engine.run",
    "ExpertTrace": "featcal.engine.run",
    "CalibrationReport": "featcal.engine.report",
    "calibrate_checkpoints": "featcal.streaming.run",
    "StreamOptions": "featcal.streaming.options",
    "merge": "featcal.baselines.registry",
    "merge_model": "featcal.baselines.registry",
    "MERGERS": "featcal.baselines.registry",
    "merge_with_data": "featcal.baselines.registry",
    "MERGERS_WITH_DATA": "featcal.baselines.registry",
    "escal": "featcal.baselines.trained.calibrators",
    "ESCalOptions": "featcal.baselines.trained.calibrators",
    "TaskCalibrated": "featcal.baselines.trained.calibrators",
    "surgery": "featcal.baselines.trained.surgery",
    "surgery_v2": "featcal.baselines.trained.surgery",
    "SurgeryOptions": "featcal.baselines.trained.surgery",
    "probsurgery": "featcal.baselines.trained.probsurgery",
    "ProbSurgeryOptions": "featcal.baselines.trained.probsurgery",
    "svc": "featcal.baselines.svc",
    "adamerging": "featcal.baselines.adamerging",
    "fisher_merging": "featcal.baselines.fisher",
}
__all__ = [*_LAZY, "evaluate"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'featcal' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def evaluate(model, zoo, split: str = "test", **kwargs) -> dict[str, float]:
    """Top-1 accuracy (percent) of ``model`` on every task of ``zoo``: ``{task: acc}``."""
    from featcal.zoo.core import evaluate as _evaluate

    return _evaluate(model, zoo, split=split, **kwargs)
