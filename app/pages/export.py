"""Export page: the calibrated model (in the format the zoo was loaded in), its report,
and the figures as PNG or HTML. An existing directory is replaced only after an
explicit confirmation, and only one featcal wrote; never the zoo's own files."""

import json
from pathlib import Path

import streamlit as st

from app import compute, controls, figures, state, ui, zoos
from app.settings import ModelRef
from featcal.util import outdir

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()
cal = controls.current_calibration(zoos.split_size(zoo, "calib"))

st.title("Export")
st.caption(
    f"The calibrated model: **{merger.label}** + exact FeatCal **{cal.label}** "
    "(change them on the Zoo and Calibrate pages)."
)
with ui.status(f"Running exact FeatCal: {cal.label}…") as s:
    run = state.calibrated(source, fp, merger, cal)
    s.update(label=f"Calibrated model ready ({run.report.summary()})", state="complete")
mer_ref, cal_ref = ModelRef.merged(merger), ModelRef.calibrated(merger, cal)
with ui.status("Scoring the merged and the calibrated model, measuring their drift…") as s:
    d_mer, d_cal = state.drift(source, fp, mer_ref), state.drift(source, fp, cal_ref)
    live = state.live_test(source)
    mer_scores, cal_scores = state.scores(source, fp, mer_ref, live), state.scores(source, fp, cal_ref, live)
    s.update(label="Scores and drift ready", state="complete")
report = run.report.to_dict() | {
    "zoo": {"name": zoo.name, "source": source, "fingerprint": fp},
    "merger": {"method": merger.method, **merger.kwargs},
    "n_per_task": cal.n,
    "scores": compute.scores_summary({"merged": mer_scores, "calibrated": cal_scores}, state.live_note(zoo)),
    "drift": compute.drift_summary({"merged": d_mer, "calibrated": d_cal}, state.DIAG_N),
}

# 1. The model and its report, written atomically by featcal.zoo.io.save_model.
st.subheader("Model")
# An absolute default, shown in full: the user sees where the files go (the server's working directory).
default_dir = str(Path("featcal-out").resolve() / f"{zoo.name}-{merger.method}-featcal-{state.short_hash(cal_ref)}")
out_dir = st.text_input("output directory", default_dir, key="export_dir")
target = Path(out_dir).expanduser().resolve()
st.caption(f"Writes to `{target}`")
exists = target.exists() or target.is_symlink()
replace, blocked = False, None
try:  # never over the zoo it reads; an existing directory only if featcal wrote it (featcal.util.outdir)
    outdir.check_output(target, force=True, inputs=zoo.input_paths())
except ValueError as exc:
    blocked = str(exc)
if blocked is not None:
    st.warning(f"{blocked}", icon=":material/block:")
elif exists:
    st.warning(f"`{target}` already exists (an earlier export of featcal's).", icon=":material/warning:")
    replace = st.checkbox(
        "Replace the existing directory (the old one is removed once the new one is written)", key="export_replace"
    )
if st.button(
    f"Save the calibrated model ({zoo.fmt} format) and report.json",
    type="primary",
    disabled=not out_dir.strip() or blocked is not None or (exists and not replace),
):
    from featcal.zoo.io import OutputExistsError, save_model, zoo_card

    try:
        card = zoo_card(
            zoo,
            report["merger"],
            report,
            calibration={"n_per_task": cal.n},
            scores=report["scores"],
            drift=report["drift"],
        )
        path = state.on_shared_models(
            source,
            lambda: save_model(
                run.model,
                target,
                fmt=zoo.fmt,
                force=replace,
                extra_files={"report.json": report},
                config=None if zoo.fmt == "hf" else {"zoo": zoo.name, "source": source},
                hub=card,
                inputs=zoo.input_paths(),
            ),
        )
        st.success(f"Saved to `{path}`.")
    except OutputExistsError as exc:
        st.error(f"{exc} Tick the confirmation box to replace it.")
    except (OSError, ValueError, RuntimeError) as exc:  # (RuntimeError: another export holds its lock)
        st.error(f"Could not save: {exc}")
st.download_button(
    "Download report.json",
    json.dumps(report, indent=2, default=str),
    "report.json",
    "application/json",
    key="dl_report",
)

# 2. Figures.
st.subheader("Figures")
sq = figures.value_range([d_mer, d_cal], figures.SQUARED, stacked=True)
nm = figures.value_range([d_mer, d_cal], figures.NORMS)
names = zoos.block_names(zoo)  # an encoder-decoder's blocks by name (encoder.block.3, decoder.block.0)
FIGS = {
    "drift-merged": lambda: figures.drift_decomposition(
        d_mer, "merged: drift per block", sq_range=sq, norm_range=nm, names=names
    ),
    "drift-calibrated": lambda: figures.drift_decomposition(
        d_cal, "calibrated: drift per block", sq_range=sq, norm_range=nm, names=names
    ),
    "heatmap-merged": lambda: figures.drift_heatmap(d_mer, "merged: relative drift", names=names),
    "heatmap-calibrated": lambda: figures.drift_heatmap(d_cal, "calibrated: relative drift", names=names),
    "accuracy": lambda: figures.accuracy_bars(
        compute.accuracy_frame(
            {"merged": mer_scores["output"], "calibrated": cal_scores["output"]}, expert_from="merged"
        )
    ),
    "residuals": lambda: figures.residuals(run.report.to_frame(), names=names),
}
name = st.selectbox("figure", list(FIGS), key="export_fig")
fig = FIGS[name]()
st.plotly_chart(fig, key="export_preview")
c1, c2 = st.columns(2)
c1.download_button("Download HTML", figures.to_html(fig), f"{name}.html", "text/html", key="dl_html")
if c2.button("Render PNG", key="render_png", help="Rendered by kaleido through Chromium (a few seconds)."):
    with st.spinner("Rendering PNG with kaleido…"):
        try:
            st.session_state["_png"] = (name, state.png(fig.to_json()))
        except Exception as exc:  # kaleido raises its own types when no browser is found
            st.session_state.pop("_png", None)
            c2.error(
                f"PNG export needs Chrome or Chromium, which kaleido could not start "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                "Fix: `sudo apt-get install chromium` (Debian/Ubuntu) or `plotly_get_chrome`; "
                "HTML export works without it."
            )
png = st.session_state.get("_png")
if png is not None and png[0] == name:
    c2.download_button("Download PNG", png[1], f"{name}.png", "image/png", key="dl_png")
