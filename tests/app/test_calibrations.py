"""The app's one service (app/calibrations.py) without Streamlit: it imports without it, its
methods take the locks their work needs, a run computed ahead is taken rather than computed
again, a preview is written into the scratch model once per run and setting, and what a run's
preview needs is prepared once. The pages' side: tests/app/test_app.py."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from app.calibrations import Calibrated, Calibrations
from app.settings import AppCal, Merger, ModelRef

ROOT = Path(__file__).resolve().parents[2]
MERGER = Merger("task_arithmetic", (("scale", 0.3),))
CAL = AppCal.from_widgets(-1.3, 2.0, 0.3, 8, True, True)
KEY = ("src", "fp", MERGER, CAL)


class Report:
    def __init__(self):
        self.preview_state = None


def _run(seconds: float = 1.0) -> Calibrated:
    return Calibrated(torch.nn.Linear(2, 2), Report(), seconds)


def test_the_service_imports_without_streamlit():
    code = "import sys, app.calibrations; assert 'streamlit' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=300)


def test_work_on_the_shared_models_holds_the_shared_lock_without_autograd():
    service = Calibrations(budget=lambda: 1 << 30)
    seen = []

    def job():
        other = threading.Thread(target=lambda: seen.append(service.shared.acquire(timeout=0)))
        other.start()
        other.join(10)
        return torch.is_grad_enabled()

    assert service.on_shared_models("src", job) is False
    assert seen == [False]  # another thread could not take it meanwhile


def test_a_run_computed_ahead_is_taken_and_a_new_one_counts_its_blocks():
    service = Calibrations(budget=lambda: 1 << 30)
    ahead = _run()
    service.ahead.reserve(KEY).set_result(ahead)
    assert service.calibrated(KEY, lambda on_block: pytest.fail("computed again")) is ahead
    assert not service.ahead.has(KEY) and service.was_run(KEY) and not service.to_compute(KEY)
    seen = []
    moved = ("src", "fp", MERGER, CAL.moved(-1.0, 2.0, 0.3))

    def exact(on_block):
        on_block(0, {"done": 1, "blocks": 3})
        seen.append(service.blocks_done(moved))
        return _run(2.0)

    run = service.calibrated(moved, exact)
    assert seen == [(1, 3)] and service.blocks_done(moved) is None
    assert service.run_of(moved) is run and service.last_seconds() == 2.0
    with service.preview_from(("src", "fp", MERGER, CAL.moved(-0.5, 2.0, 0.3))) as from_run:
        assert from_run == moved[3]  # the latest run of the same structure


def test_a_preview_is_written_once_per_run_and_setting(monkeypatch):
    from app import compute

    service = Calibrations(budget=lambda: 1 << 30)
    written, prepared = [], []
    monkeypatch.setattr(compute, "load_preview", lambda scratch, model, report, config: written.append(config))
    monkeypatch.setattr(compute, "prepare_preview", lambda preview: prepared.append(preview))
    zoo = type("Zoo", (), {"base": torch.nn.Linear(2, 2)})()
    run = _run()
    run.report.preview_state = "statistics"
    service.prepare_preview(run)
    first = run.prepared
    service.prepare_preview(run)  # once per run
    assert first is run.prepared and first.result(10) is None and prepared == ["statistics"]
    ref = ModelRef.preview(MERGER, CAL, CAL.moved(-1.0, 2.0, 0.3))
    for _ in range(2):
        with service.preview("src", "fp", ref, run, zoo, hooks=False) as model:
            assert isinstance(model, torch.nn.Linear) and model is not zoo.base
    assert written == [ref.cal.config]  # its scores, cosines and drift: one write
    other = _run()  # a newer run of the same settings: written again
    other.report.preview_state, other.prepared = "statistics", Future()
    other.prepared.set_result(None)
    with service.preview("src", "fp", ref, other, zoo, hooks=True):
        assert service.shared._is_owned() and service.scratch._is_owned()
    assert len(written) == 2
    gone = _run()  # statistics released, never prepared: a message that says what to do
    with pytest.raises(RuntimeError, match="Fix"):
        with service.preview("src", "fp", ref, gone, zoo, hooks=False):
            pass


def test_kept_streams_and_memo_stay_small():
    service = Calibrations(budget=lambda: 1 << 30)
    for i in range(3):
        service.keep_streams(("src", "fp", i), f"streams {i}")
    assert service.take_streams(("src", "fp", 0)) is None  # the oldest left
    assert service.take_streams(("src", "fp", 2)) == "streams 2" and service.take_streams(("src", "fp", 2)) is None
    calls = []
    for _ in range(2):
        assert service.memoized(lambda x: calls.append(x) or x * 2, 21) == 42
    assert calls == [21]
