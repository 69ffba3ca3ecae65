"""The Streamlit app under AppTest (no browser): every page runs, every slider moves the
numbers, a bad zoo path is an error message, the URL restores a view, export never
overwrites silently. Most tests use a tiny zoo directory (tests/app_zoo.py); the
``demo_zoo`` ones open the app exactly as a user does, on the embedded demo. The app's parts
without AppTest (settings, figures, library calls): tests/app/test_app_parts.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
OTHER = "other (path)…"
TIMEOUT = 1800  # stops a hang only: the first run imports torch and transformers and may build the demo zoo


def _app(path: str | None = None, **query) -> AppTest:
    """The app at a URL: ``path`` picks "other (path)…" with that zoo; ``query`` adds parameters."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if path is not None:
        at.query_params["zoo"] = OTHER
        at.query_params["zoo_path"] = path
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def _numbers(at: AppTest) -> list[tuple[str, str, str]]:
    return [(m.label, m.value, m.delta) for m in at.metric]


def _page(at: AppTest, page: str) -> AppTest:
    return _ok(at.switch_page(f"pages/{page}.py").run())


# ----------------------------------------------------------------------------- tiny zoo


def test_every_page_runs_on_a_zoo_directory(tiny_zoo_dir):
    at = _ok(_app(tiny_zoo_dir).run())
    labels = [m.label for m in at.metric]
    assert "merged, mean accuracy" in labels and "experts" in labels
    for page in ("calibrate", "drift", "export"):
        _page(at, page)
    assert any(m.label == "mean accuracy" for m in _page(at, "calibrate").metric)


def test_settings_another_page_applies_reach_the_widgets(tiny_zoo_dir):
    """What Tune's "Apply to Calibrate" does: Session State values for every Calibrate widget
    (n included) and a notice."""
    from app import controls

    at = _ok(_app(tiny_zoo_dir).run())
    for key, value in {"log_lam": -1.0, "rho": 1.5, "alpha": 0.45, "n_cal": 8}.items():
        at.session_state[key] = value
    at.session_state[controls.APPLIED] = "Applied the Tune page's choice: λ=0.1, ρ=1.5, α=0.45, n=8."
    at = _page(at, "calibrate")  # (Streamlit's default-value warning needs a server: the browser test reads its log)
    assert any("n=8/task" in s.value and "λ=0.1," in s.value for s in at.success), [s.value for s in at.success]
    assert any("Applied the Tune page's choice" in t.value for t in at.toast)


def test_the_weights_page_shows_every_view_beside_the_drift(tiny_zoo_dir):
    at = _page(_ok(_app(tiny_zoo_dir).run()), "weights")
    assert len(at.get("plotly_chart")) == 4 and len(at.dataframe) == 1
    assert any("Spearman" in c.value for c in at.caption)
    names = {b.proto.label for b in at.get("download_button")}
    for name in ("weights_vs_drift", "weights_per_block", "weights_per_tensor", "weights_drift_correlation"):
        assert {f"{name}.csv", f"{name}.parquet"} <= names, names
    for view in ("spectral_overlap", "tau_norm"):  # every view draws
        at.session_state["w_view"] = view
        _ok(at.run())
        assert len(at.get("plotly_chart")) == 4


def _write_your_models(at: AppTest, name: str, root: Path, merged: Path | None = None) -> AppTest:
    """Fill the Zoo page's Your models form from ``root`` (base/, data/, experts/) and press
    its button; the app after that run."""
    at.text_input(key="yours_name").input(name)
    for key in ("base", "data", "experts"):
        at.text_input(key=f"yours_{key}").input(str(root / key))
    if merged is not None:
        at.text_input(key="yours_merged").input(str(merged))
    next(b for b in at.button if "zoo YAML" in b.label).click()
    return _ok(at.run())


def test_your_models_form_writes_a_zoo_and_opens_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "zoo"))  # the zoo tests' tiny models
    from test_userspec import write_user_models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "cache"))
    root = write_user_models(tmp_path / "mine")
    at = _write_your_models(_app().run(), "tiny-mine", root)
    written = tmp_path / "cache" / "zoos" / "yours" / "tiny-mine.yaml"
    assert written.is_file() and at.session_state["_yours_written"][0] == str(written)
    assert any("experts:" in c.value for c in at.code)  # the YAML, shown to keep
    # The next run of the main script opens it (AppTest reruns only the page: checked at its URL;
    # the browser test follows the whole flow).
    at = _ok(_app(str(written)).run())
    assert "Zoo · tiny-mine" in [t.value for t in at.title]


def test_your_models_form_takes_text_files_and_a_merged_model(tmp_path, monkeypatch):
    """Text and token files per task, and a merged model of one's own: the form writes a text
    zoo whose merger defaults to that model; the Zoo and Calibrate pages run on it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "zoo"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from test_userspec import write_text_models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "cache"))
    root = write_text_models(tmp_path / "words")
    at = _write_your_models(_app().run(), "tiny-words", root, merged=root / "experts" / "colour")
    text = at.session_state["_yours_written"][1]
    assert "modality: text" in text and "merged:" in text and "animal.npz" in text
    at = _ok(_app(at.session_state["_yours_written"][0]).run())
    assert "Zoo · tiny-words" in [t.value for t in at.title]
    assert at.selectbox(key="merge").value == "given"
    assert at.selectbox(key="merge").options[0] == "your merged model (the zoo's own)"
    assert "your merged model" in list(at.dataframe[0].value.role)  # the Models table lists it
    assert any(m.label == "merged, mean accuracy" for m in at.metric)
    _ok(at.selectbox(key="merge").set_value("task_arithmetic").run())
    _page(at, "calibrate")
    assert any(m.label == "mean accuracy" for m in at.metric)


@pytest.mark.parametrize("page", ["zoo", "calibrate", "tune", "compare", "generate"])
def test_the_library_warnings_badge_is_on_every_page(tiny_zoo_dir, page):
    """Tune, Compare and Generate stop early (st.stop) until their button is pressed: the
    sidebar's badge is drawn before the page too, so it is there whatever the page does."""
    from app import state

    state.calibrations().warnings.record("a warning the library gave", UserWarning, "x.py", 1)
    at = _app(tiny_zoo_dir).switch_page(f"pages/{page}.py").run()  # the main script and the page (the sidebar)
    assert not at.exception, [e.value for e in at.exception]
    labels = [e.label for e in at.sidebar.expander]
    assert any(label.startswith("Library warnings (") for label in labels), labels


@pytest.mark.parametrize("key,value", [("log_lam", 0.5), ("rho", 0.5), ("alpha", 0.9)])
def test_each_calibration_slider_changes_the_numbers(tiny_zoo_dir, key, value):
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    before = _numbers(at)
    _ok(at.slider(key=key).set_value(value).run())
    assert at.slider(key=key).value == value
    assert _numbers(at) != before


def test_calibration_size_and_switches_change_the_numbers(tiny_zoo_dir):
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    seen = [_numbers(at)]
    _ok(at.select_slider(key="n_cal").set_value(8).run())
    seen.append(_numbers(at))
    _ok(at.toggle(key="bias").set_value(False).run())
    seen.append(_numbers(at))
    _ok(at.toggle(key="layernorm").set_value(False).run())
    seen.append(_numbers(at))
    assert all(a != b for a, b in zip(seen, seen[1:]))


def test_preview_then_exact_result_is_shown(tiny_zoo_dir):
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    _ok(at.slider(key="alpha").set_value(0.6).run())
    # The script's final state is the exact result (the preview was drawn first, then replaced).
    assert any("Exact FeatCal" in s.value for s in at.success)
    assert not any("Preview" in i.value for i in at.info)


def test_the_table_and_residuals_are_drawn_only_when_opened(tiny_zoo_dir):
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    # The drift chart, the two cosine charts and the experts' task-vector matrix; no table.
    assert len(at.get("plotly_chart")) == 4 and not at.dataframe
    at.session_state["cal_residuals_open"] = True  # what a click on them does
    at.session_state["cal_table"] = True
    _ok(at.run())
    assert len(at.get("plotly_chart")) == 5 and len(at.dataframe) == 1
    assert any("Exact FeatCal done" in c.value for c in at.caption)  # the status line


@pytest.mark.parametrize("after,value,previewed", [(0.0, 0.65, True), (60.0, 0.7, False)])
def test_the_preview_is_drawn_only_while_the_exact_run_is_slow(tiny_zoo_dir, monkeypatch, after, value, previewed):
    from app import compute, settings

    real_calibrate, real_preview = compute.calibrate, compute.load_preview
    previews = []
    monkeypatch.setattr(settings, "PREVIEW_AFTER_S", after)
    monkeypatch.setattr(compute, "calibrate", lambda *a, **k: time.sleep(0.3) or real_calibrate(*a, **k))
    prepared = []  # at each preview: whether its run's eigendecompositions were all done before it, in the background

    def preview(scratch, model, report, config):
        from app import state

        ps = report.preview_state
        run = next(r for r in state.calibrations().latest.kept() if r.report is report)
        prepared.append(run.prepared is not None and len(ps._eig) == len(ps._same_S))
        previews.append(config)
        return real_preview(scratch, model, report, config)

    monkeypatch.setattr(compute, "load_preview", preview)
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    _ok(at.slider(key="alpha").set_value(value).run())
    assert any("Exact FeatCal" in s.value for s in at.success)
    assert any(config.alpha == value for config in previews) == previewed, previews
    # The preview is written into the scratch model once: its scores, cosines and drift share it,
    # from a run whose one-off eigendecompositions were done in the background after it was drawn.
    assert sum(config.alpha == value for config in previews) == int(previewed), previews
    assert all(prepared), prepared


def test_only_the_run_a_preview_starts_from_keeps_its_statistics(tiny_zoo_dir, monkeypatch):
    """Each exact run keeps statistics for the preview (gigabytes on a language model): once a
    newer run of the same data and switches is done, the older one's are freed; the newest's
    are decomposed in the background, each Linear's statistics freed once decomposed."""
    from app import compute, state

    real_calibrate, reports = compute.calibrate, []

    def calibrate(*a, **k):
        model, report = real_calibrate(*a, **k)
        reports.append(report)
        return model, report

    monkeypatch.setattr(compute, "calibrate", calibrate)
    at = _page(_app(tiny_zoo_dir, rho=1.15).run(), "calibrate")
    for alpha in (0.35, 0.4, 0.55):
        _ok(at.slider(key="alpha").set_value(alpha).run())
    assert len(reports) == 4
    next(r for r in state.calibrations().latest.kept() if r.report is reports[-1]).prepared.result(timeout=1800)
    kept = [r for r in reports if r.preview_state is not None]
    assert kept == [reports[-1]], [r.config.alpha for r in kept]
    linears = [e for e in kept[0].preview_state.entries if e.target.kind == "linear"]
    assert linears and all(e.system.S is None for e in linears)  # compacted


def test_a_preview_is_drawn_even_when_its_exact_run_finishes_first(tiny_zoo_dir, monkeypatch):
    """The exact run can finish (and displace the run a preview starts from) between the
    page's choice to preview and the preview's reading of the statistics: the page holds that
    run until the preview is drawn, then lets it go."""
    from app import compute, settings, state

    real_calibrate, real_preview = compute.calibrate, compute.load_preview
    monkeypatch.setattr(settings, "PREVIEW_AFTER_S", 0.0)
    exact_done, raced, reports = threading.Event(), [], []

    def calibrate(*a, **k):
        model, report = real_calibrate(*a, **k)
        reports.append(report)
        return model, report

    def remember(key, cal, run, real=state.calibrations().latest.remember):
        real(key, cal, run)
        exact_done.set()

    def preview(scratch, model, report, config):
        raced.append(exact_done.wait(1800))  # the exact run of this setting is done and remembered
        return real_preview(scratch, model, report, config)

    monkeypatch.setattr(compute, "calibrate", calibrate)
    at = _page(_app(tiny_zoo_dir, rho=0.85).run(), "calibrate")
    monkeypatch.setattr(compute, "load_preview", preview)
    monkeypatch.setattr(state.calibrations().latest, "remember", remember)
    _ok(at.slider(key="alpha").set_value(0.25).run())
    assert raced and all(raced), raced
    assert any("Exact FeatCal" in s.value for s in at.success)
    assert len(reports) == 2 and reports[0].preview_state is None  # let go once the preview was drawn


def test_the_calibration_gets_the_config_the_url_sets(tiny_zoo_dir, monkeypatch):
    """log10 λ from the URL reaches featcal as ``config.lam`` (values no other test uses: the
    exact runs are cached for the whole process)."""
    from app import compute
    from featcal import FeatCalConfig

    real_calibrate, configs = compute.calibrate, []
    monkeypatch.setattr(compute, "calibrate", lambda *a, **k: configs.append(a[3]) or real_calibrate(*a, **k))
    _page(_app(tiny_zoo_dir, log_lam=-2.7, rho=1.35, alpha=0.45, n_cal=16, bias="false").run(), "calibrate")
    assert configs == [FeatCalConfig.clip(lam=0.002, rho=1.35, alpha=0.45, bias=False, layernorm=True)]  # 10^-2.7


@pytest.mark.parametrize(
    "method,key,value",
    [
        ("task_arithmetic", "task_arithmetic_scale", 0.8),
        ("ties", "ties_density", 0.6),
        ("ties", "ties_scale", 0.5),
        ("iso_c", "iso_c_scale", 0.5),
        ("iso_cts", "iso_cts_common_space_fraction", 0.3),
        ("tsv", "tsv_scale", 0.5),
    ],
)
def test_each_merger_slider_changes_the_numbers(tiny_zoo_dir, method, key, value):
    at = _ok(_app(tiny_zoo_dir).run())
    if method != "task_arithmetic":
        _ok(at.selectbox(key="merge").set_value(method).run())
    before = _numbers(at)
    _ok(at.slider(key=key).set_value(value).run())
    assert _numbers(at) != before


def test_url_restores_the_settings(tiny_zoo_dir):
    at = _page(_app(tiny_zoo_dir, rho=1.25, alpha=0.55, log_lam=-2.0).run(), "calibrate")
    assert at.slider(key="rho").value == 1.25
    assert at.slider(key="alpha").value == 0.55
    assert "λ=0.01" in " ".join(s.value for s in at.success)


def test_settings_follow_to_the_other_pages(tiny_zoo_dir):
    at = _page(_app(tiny_zoo_dir).run(), "calibrate")
    _ok(at.slider(key="rho").set_value(1.5).run())
    _page(at, "drift")
    assert "ρ=1.5" in " ".join(c.value for c in at.caption)


@pytest.mark.parametrize("path", ["/nonexistent/zoo.yaml", "/nonexistent-dir", ""])
def test_a_bad_zoo_path_is_an_error_message(path):
    at = _app(path).run()
    assert not at.exception
    assert at.error, "expected an st.error"
    assert "Fix" in at.error[0].value or "fix" in at.error[0].value


def test_a_malformed_spec_is_an_error_message(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: [unclosed\n")
    at = _app(str(spec)).run()
    assert not at.exception
    assert at.error and "bad.yaml" in at.error[0].value


def test_export_never_overwrites_without_confirmation(tiny_zoo_dir, tmp_path):
    out = tmp_path / "out"
    at = _page(_app(tiny_zoo_dir).run(), "export")
    assert Path(at.text_input(key="export_dir").value).is_absolute()  # the default: a visible, absolute path
    at.text_input(key="export_dir").set_value(str(out)).run()
    save = next(b for b in at.button if b.label.startswith("Save"))
    _ok(save.click().run())
    assert (out / "report.json").is_file() and (out / "featcal_model.json").is_file()
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md").data  # the hub model card (featcal.model.export)
    assert card.tags == ["merge", "featcal"] and card.featcal["merge"]["method"] and "lam" in card.featcal["settings"]
    report = json.loads((out / "report.json").read_text())
    for model in ("merged", "calibrated"):  # the results travel with the settings
        assert 0.0 <= report["scores"][model]["mean"]["accuracy"] <= 100.0
        assert set(report["scores"][model]["per_task"]) == set(report["scores"]["merged"]["per_task"]) != set()
        assert report["drift"]["mean_over_tasks_per_block"][model]["0"]["drift_rel"] >= 0.0
    stamp = (out / "report.json").stat().st_mtime_ns
    at.run()
    save = next(b for b in at.button if b.label.startswith("Save"))
    assert save.disabled and at.warning
    _ok(at.checkbox(key="export_replace").check().run())
    save = next(b for b in at.button if b.label.startswith("Save"))
    assert not save.disabled
    _ok(save.click().run())
    assert (out / "report.json").stat().st_mtime_ns != stamp


# ----------------------------------------------------------------------------- demo zoo


@pytest.fixture(scope="module")
def demo_built():
    """Build (or check) the demo zoo's cache before the app's first run, outside its timeout."""
    from featcal.zoo import load_demo

    load_demo(progress=False)


@pytest.mark.demo_zoo
def test_the_app_opens_on_the_demo_zoo(demo_built):
    at = _ok(_app().run())
    assert at.selectbox(key="zoo").value == "demo"
    assert any("demo" in t.value for t in at.title)
    assert any(m.label == "merged, mean accuracy" for m in at.metric)


@pytest.mark.slow
@pytest.mark.demo_zoo
def test_every_slider_moves_the_numbers_on_the_demo_zoo(demo_built):
    at = _page(_app().run(), "calibrate")
    for kind, key, value in [
        ("slider", "log_lam", -0.5),
        ("slider", "rho", 1.0),
        ("slider", "alpha", 0.7),
        ("select_slider", "n_cal", 32),
    ]:
        before = _numbers(at)
        _ok(getattr(at, kind)(key=key).set_value(value).run())
        assert _numbers(at) != before, key
    for page in ("drift", "export", "zoo"):
        _page(at, page)


def test_png_export_without_chromium_is_a_clear_message(tiny_zoo_dir, monkeypatch):
    from app import figures

    def no_browser(fig, scale=2.0):
        raise RuntimeError("Kaleido requires Google Chrome to be installed.")

    monkeypatch.setattr(figures, "to_png", no_browser)
    at = _page(_app(tiny_zoo_dir).run(), "export")
    at.button(key="render_png").click().run()
    assert not at.exception
    assert at.error and "Chromium" in at.error[0].value and "HTML export works" in at.error[0].value


def test_a_spec_with_missing_models_lists_them():
    at = _app(None, zoo="assets/zoos/clip-vit-b32-ta8.yaml").run()
    assert not at.exception
    assert at.error and "not on this machine" in at.error[0].value and "fix" in at.error[0].value


def test_a_zoo_build_reports_its_progress_on_the_page(monkeypatch):
    """When the demo zoo must be built, the app builds it with a progress callback (drawn as
    st.progress with the stage, step and time left) before loading it."""
    from app import zoos
    from featcal.util.progress import Progress

    calls = []

    def fake_build(source, on_step):
        for step in range(3):
            on_step(Progress("pretrain the base", step, 2, step / 2, 1.0 + step, 10.0 - step))
        calls.append(source)

    monkeypatch.setattr(zoos, "zoo_needs_build", lambda source, ready: not calls)
    monkeypatch.setattr(zoos, "build_zoo", fake_build)
    at = _ok(_app().run())
    assert calls == ["demo"]  # built once, then loaded (from the shipped copy)
    assert any(m.label == "merged, mean accuracy" for m in at.metric)
