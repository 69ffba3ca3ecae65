"""featcal: post-merging feature calibration (FeatCal) and feature-drift diagnostics.

Usage::

    from featcal import FeatCalConfig, calibrate, merge_model
    merged = merge_model("task_arithmetic", base, experts, scale=0.3)  # a model; merge() gives a state dict
    model, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig.clip())
"""

from featcal import _moved  # noqa: F401  (installs the old flat layout's import names; see its docstring)
from featcal.baselines.adamerging import adamerging
from featcal.baselines.fisher import fisher_merging
from featcal.baselines.registry import MERGERS, MERGERS_WITH_DATA, merge, merge_model, merge_with_data
from featcal.baselines.svc import svc
from featcal.baselines.trained.calibrators import ESCalOptions, TaskCalibrated, escal
from featcal.baselines.trained.surgery import SurgeryOptions, surgery, surgery_v2
from featcal.config import FastPaths, FeatCalConfig, Setting, TokenWeights
from featcal.engine.report import CalibrationReport
from featcal.engine.run import ExpertTrace, calibrate
from featcal.streaming.options import StreamOptions
from featcal.streaming.run import calibrate_checkpoints

__all__ = [
    "FeatCalConfig",
    "FastPaths",
    "Setting",
    "TokenWeights",
    "calibrate",
    "calibrate_checkpoints",
    "StreamOptions",
    "ExpertTrace",
    "merge",
    "merge_model",
    "MERGERS",
    "merge_with_data",
    "MERGERS_WITH_DATA",
    "CalibrationReport",
    "evaluate",
    "escal",
    "ESCalOptions",
    "surgery",
    "surgery_v2",
    "SurgeryOptions",
    "TaskCalibrated",
    "svc",
    "adamerging",
    "fisher_merging",
]
__version__ = "0.1.0"


def evaluate(model, zoo, split: str = "test", **kwargs) -> dict[str, float]:
    """Top-1 accuracy (percent) of ``model`` on every task of ``zoo``: ``{task: acc}``."""
    from featcal.zoo.core import evaluate as _evaluate

    return _evaluate(model, zoo, split=split, **kwargs)
