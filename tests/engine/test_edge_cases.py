"""Edge cases where featcal must be exact or refuse clearly (issue 16, items 4-10): each
test here failed before its fix."""

from __future__ import annotations

import warnings

import torch

from featcal import FeatCalConfig, calibrate
from featcal.reference import calibrate_reference
from tiny import all_target_params, toy_data, toy_zoo


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lam_zero_with_fewer_rows_than_width_is_resolved_in_float64_and_warned():
    """lam = 0, 10 rows for a width of 32 (fc2): float32 statistics make S + eps I numerically
    indefinite. The solve must match the float64 spec solution (a float32 LU was 7x off) and
    say so in report.warnings and a Python warning."""
    base, experts, merged = toy_zoo(n_tasks=2, std=0.3, d=16, hidden=32)
    data = toy_data(experts, n=1, tokens=5, batch=1)
    cfg = FeatCalConfig(lam=0.0, modules=("fc2",), layernorm=False)  # fc2 reads well-posed rows (no LayerNorm)
    want = all_target_params(calibrate_reference(merged, base=base, experts=experts, calib_data=data, config=cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    for key, (W, b) in all_target_params(model).items():
        if key[1] == "fc2":
            assert _rel(W, want[key][0]) < 1e-4, key
            assert _rel(b, want[key][1]) < 1e-4, key
    fallback = [m for m in report.warnings if "re-solved in float64" in m]
    assert fallback and "block 0 fc2" in fallback[0]
    assert any("re-solved in float64" in str(w.message) for w in caught)
    # float64 statistics need no fallback
    _, report64 = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg.with_(stats_dtype=torch.float64), progress=False
    )
    assert not [m for m in report64.warnings if "re-solved" in m]
