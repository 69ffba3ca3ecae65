"""Latency of the app's Calibrate page: slider release -> updated numbers and plots.

Three measurements on a zoo (default: the embedded demo), each a fresh setting so
every one runs the exact forward-order FeatCal (nothing served from the cache):

1. ``parts``: the work one slider change can trigger, timed piece by piece without
   Streamlit: the instant preview's scores, cosines and drift as the page computes them
   (only when the exact run is slow; timed here on their own), the exact calibration alone
   on a worker thread with the threads the app gives it, then the new model's output scores beside its expert
   cosines and drift (the drift reusing the model's streams kept while its features were
   read for the cosines, and the experts' streams cached as the app keeps them). Besides wall
   time, each piece's CPU time (``time.thread_time``): on a shared machine wall time mostly
   measures the other processes, while the CPU seconds on the critical path,
   ``calibrate + max(scores, drift)``, are what two free cores would take (the calibration runs on
   every core, and its CPU time counts the calling thread's only);
2. ``apptest``: one whole script rerun after ``slider.set_value(...)`` under
   ``streamlit.testing`` (the preview pass when the exact run takes longer than
   ``app.settings.PREVIEW_AFTER_S``, then the exact pass, every element drawn);
3. ``browser`` (``--browser``, needs Debian chromium): ``streamlit run`` plus
   Playwright. Each change starts from an idle page (the previous result drawn, nothing
   running), as a user moves a slider after looking at the last result; timed from the
   slider's release (the thumb dragged one step with the mouse and let go: the issue's
   measure) and, separately, from an arrow key press on the focused thumb (which the
   browser holds ~0.24 s before sending it to the server), until the metric text has
   changed ("first new numbers") and until the page's status line reports the exact run
   done, which the page writes after its drift chart, plus two animation frames for the
   browser to paint it ("exact result, plots drawn": what a user waits for), and until the
   last change to any chart once none has changed for 0.4 s ("every chart settled").

    python benchmarks/app_latency.py                 # parts + apptest on the demo zoo
    python benchmarks/app_latency.py --browser       # + the real browser
    python benchmarks/app_latency.py --zoo path/to/zoo --n 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app_latency_browser import bench_browser

import _common

_common.setup_path()


# ----------------------------------------------------------------------------- 1. parts


def bench_parts(source: str, n: int, repeats: int, record: dict | None = None, preview: bool = True) -> list[dict]:
    """The app's work for one slider change, piece by piece, as :mod:`app.state` runs it:
    the preview's scores (only when the exact run is slow; timed on their own; not with
    ``preview=False``), the exact calibration alone on the worker thread, then the exact model's
    expert cosines and drift (worker; the hooked passes on copies) and its output scores (here)
    side by side. The settings are the app's defaults for the zoo's preset, rho moved."""
    import copy

    import torch

    from app import compute, zoos
    from app.settings import AppCal, cal_defaults
    from featcal.config import preset_for_zoo

    dev = zoos.device()
    zoo = zoos.load_zoo(source, dev)
    torch.set_num_threads(zoos.cpu_threads(zoo, dev))  # as the app does
    preset = preset_for_zoo(zoo)
    default = cal_defaults(preset)

    def setting(rho: float = default["rho"]):
        """The app's default setting on this zoo with ``rho``, as the widgets make it."""
        d = default
        return AppCal.from_widgets(d["log_lam"], rho, d["alpha"], n, d["bias"], d["layernorm"], preset).config

    merged = zoo.merged("task_arithmetic", scale=0.3)
    data = zoo.calib_data(n, seed=42)
    diag = zoo.calib_data(min(compute.DIAG_N, zoos.split_size(zoo, "val")), seed=0, split="val")
    live = compute.live_test(zoo)
    side = compute.expert_side(zoo, diag, live)  # once per zoo in the app
    streams = compute.expert_streams(zoo, diag)  # likewise
    compute.scores(merged, zoo, diag, live, side)  # warm-up (allocator, first-call costs)
    trace = compute.expert_trace()  # once per zoo and size, as the app keeps it
    model0, rep0 = compute.calibrate(merged, zoo, data, setting(), trace)  # the app's default setting
    kept_raw = rep0.preview_state.nbytes()
    compute.prepare_preview(rep0.preview_state)
    kept_stats = rep0.preview_state.nbytes()  # what the app keeps per run it previews from
    scratch = zoo.merged("task_arithmetic", scale=0.3)
    scratch = compute.load_preview(scratch, rep0.preview_state.template, rep0, setting())
    pieces = (
        "preview: load_into",
        "preview: scores + cosines + drift",
        "exact: calibrate",
        "exact: output scores",
        "exact: cosines + drift",
    )
    wall: dict[str, list[float]] = {k: [] for k in (*pieces, "preview shown", "exact shown")}
    cpu: dict[str, list[float]] = {k: [] for k in (*pieces, "preview shown", "exact shown")}
    split: dict[str, list[float]] = {k: [] for k in SPLIT}  # the exact run's own account (wall s)

    def clock() -> tuple[float, float]:
        """(wall, this thread's CPU) seconds."""
        _common.sync(dev)
        return time.perf_counter(), time.thread_time()

    from app.settings import PREVIEW_TEST

    pv_side = compute.ExpertSide(PREVIEW_TEST, {t: v[:PREVIEW_TEST] for t, v in side.logits.items()}, side.features)

    def preview_scores(model):
        """What the page computes for a preview (app.state): output scores on the first
        PREVIEW_TEST test examples, the cosines with the model's streams kept, the drift on them."""
        compute.output_scores(model, zoo, pv_side)
        _, own = compute.cosine_scores_and_streams(model, zoo, diag, side)
        compute.drift(model, zoo, diag, streams, own)

    threads = torch.get_num_threads()
    solo = zoos.cpu_threads(zoo, dev, alone=True)  # the exact run's, as the app's
    pool = ThreadPoolExecutor(max_workers=1)
    prep: list[tuple[float, float]] = []  # the next preview's eigendecompositions, per exact run

    def exact(rho: float):
        torch.set_num_threads(solo)  # per thread, as app.calibrations.Calibrations does
        with torch.no_grad():
            a = clock()
            model, rep = compute.calibrate(merged, zoo, data, setting(rho), trace)
            b = clock()
            for name, v in calibration_split(rep).items():
                split[name].append(v)
            compute.prepare_preview(rep.preview_state)  # what the app does in the background once drawn
            c = clock()
            prep.append((c[0] - b[0], c[1] - b[1]))
            return model, (b[0] - a[0], b[1] - a[1])

    def heldout(model):
        torch.set_num_threads(threads)
        with torch.no_grad():
            a = clock()
            _, own = compute.cosine_scores_and_streams(copy.deepcopy(model), zoo, diag, side)  # hooks: a copy
            compute.drift(copy.deepcopy(model), zoo, diag, streams, own)
            b = clock()
            return b[0] - a[0], b[1] - a[1]

    for i in range(repeats):
        rho = default["rho"] - 0.5 + 0.1 * i  # (the demo zoo: 1.5, 1.6, ...)
        c0 = clock()  # the preview, scored only when the exact run is slow
        compute.load_preview(scratch, rep0.preview_state.template, rep0, setting(rho))
        c1 = clock()
        if preview:
            preview_scores(scratch)
        c2 = clock()
        model, cal = pool.submit(exact, rho).result()  # alone: the app's usual path
        c3 = clock()
        heldout_job = pool.submit(heldout, model)  # beside the output scores
        compute.output_scores(model, zoo, side)
        c4 = clock()
        dr = heldout_job.result()
        c5 = clock()
        for j, k in ((0, "wall"), (1, "cpu")):
            d = wall if k == "wall" else cpu
            parts = (c1[j] - c0[j], c2[j] - c1[j], cal[j], c4[j] - c3[j], dr[j])
            for name, v in zip(pieces, parts):
                d[name].append(v)
            d["preview shown"].append(parts[0] + parts[1] if j else c2[0] - c0[0])
            # CPU: the critical path on two free cores (outputs beside the worker's share).
            d["exact shown"].append(parts[2] + max(parts[3], parts[4]) if j else cal[0] + c5[0] - c3[0])
    pool.shutdown()
    wall["next preview: prepare (background)"] = [w for w, _ in prep]
    cpu["next preview: prepare (background)"] = [c for _, c in prep]
    # The figures the Calibrate page draws per result (built and serialised as plotly_chart does).
    for name, secs in _figure_seconds(zoo, merged, model0, diag, streams, side, repeats).items():
        wall[name], cpu[name] = secs, secs
    # What the page first shows for this n: mean accuracy on the live test subset, merged and exact
    # FeatCal at the default setting.
    acc = {
        name: compute.output_scores(m, zoo, side)["output"].query("metric == 'accuracy'").value.mean()
        for name, m in (("merged", merged), ("calibrated", model0))
    }
    if record is not None:  # what the Calibrate page quotes for this n (--record)
        record[str(n)] = {
            "merged": round(acc["merged"], 2),
            "calibrated": round(acc["calibrated"], 2),
            "gain_pp": round(acc["calibrated"] - acc["merged"], 1),
            "exact_cpu_s": round(statistics.median(cpu["exact shown"]), 2),
        }
    rows = [
        {
            "measure": f"accuracy, live test subset: merged {acc['merged']:.1f}%, "
            f"FeatCal (n={n}) {acc['calibrated']:.1f}% ({acc['calibrated'] - acc['merged']:+.1f} pp)",
            "median": "",
            "max": "",
            "CPU s (median)": "",
        }
    ]
    for name in wall:
        rows.append(
            {
                "measure": f"parts: {name}",
                **_common.latency_stats(wall[name]),
                "CPU s (median)": f"{statistics.median(cpu[name]):.3f} s",
            }
        )
    for name, xs in split.items():
        rows.append({"measure": f"exact run's split: {name}", **_common.latency_stats(xs), "CPU s (median)": ""})
    kept = "not kept" if streams is None else f"{streams.nbytes / 2**30:.2f} GiB"
    note = (
        f"live subset {live} test examples per task; preset {preset}; threads {threads} (exact run {solo}); "
        f"expert trace {trace.nbytes / 2**30:.2f} GiB of "
        f"{trace.max_bytes / 2**30:.2f} GiB allowed, {len(trace.captures) + len(trace.stacked)} block-batches; "
        f"experts' held-out streams {kept}; kept statistics per run {kept_raw / 2**30:.2f} GiB, "
        f"{kept_stats / 2**30:.2f} GiB once decomposed (freed as decomposed)"
    )
    rows.append({"measure": note, "median": "", "max": "", "CPU s (median)": ""})
    return rows


SPLIT = ("forward passes + statistics", "solves", "advance (calibrated block forward)")


def calibration_split(report) -> dict[str, float]:
    """The exact run's wall seconds by kind, summed over its blocks (its own
    :class:`~featcal.engine.report.BlockRecord` s): the block forward passes through the merged
    and expert blocks with the statistics, the solves, and the calibrated blocks' forwards."""
    b = report.blocks
    kinds = (sum(r.stats_seconds for r in b), sum(r.solve_seconds for r in b), sum(r.advance_seconds for r in b))
    return dict(zip(SPLIT, kinds))


def _figure_seconds(zoo, merged, model, diag, streams, side, repeats: int) -> dict[str, list[float]]:
    """Seconds to build the Calibrate page's three result charts from their tables and turn
    them into the JSON Streamlit sends (``fig.to_json()``), per repeat (one thread)."""
    from app import compute, figures

    merged_drift = compute.drift(merged, zoo, diag, streams)
    drift = compute.drift(model, zoo, diag, streams)
    tv_m, tv = (compute.output_scores(m, zoo, side)["task_vector"] for m in (merged, model))
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        rng = figures.value_range([merged_drift, drift], figures.SQUARED, stacked=True)
        figs = [
            figures.drift_decomposition(drift, "d", sq_range=rng, reference=("merged", merged_drift)),
            figures.expert_cosine_per_block({"merged": merged_drift, "calibrated": drift}, "c"),
            figures.task_vector_bars({"merged": tv_m, "calibrated": tv}, -1, "t"),
        ]
        for fig in figs:
            fig.to_json()
        out.append(time.thread_time() - t0)
    return {"figures: build + JSON (3 charts)": out}


# ----------------------------------------------------------------------------- 2. apptest


def bench_apptest(source: str, n: int, repeats: int) -> list[dict]:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(_common.APP_SCRIPT), default_timeout=900)
    if source != "demo":
        at.query_params.update({"zoo": "other (path)…", "zoo_path": source})
    at.query_params["n_cal"] = str(n)
    at.run()
    at.switch_page("pages/calibrate.py").run()
    if at.exception or at.error:
        raise RuntimeError(f"the app failed: {[e.value for e in [*at.exception, *at.error]]}")
    rows = []
    moves = {
        "log_lam": [-1.0 - 0.1 * i for i in range(repeats)],
        "rho": [1.5 + 0.05 * i for i in range(repeats)],
        "alpha": [0.5 + 0.05 * i for i in range(repeats)],
    }
    for key, values in moves.items():
        xs = []
        for v in values:
            t0 = time.perf_counter()
            at.slider(key=key).set_value(round(v, 4)).run()
            xs.append(time.perf_counter() - t0)
            if at.exception:
                raise RuntimeError(at.exception[0].value)
        rows.append({"measure": f"apptest: rerun after {key} change", **_common.latency_stats(xs)})
    return rows


# ----------------------------------------------------------------------------- 3. browser


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="demo", help="demo (default), a spec YAML or a zoo directory")
    ap.add_argument("--n", type=int, default=None, help="calibration examples per task (default: the app's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--browser", action="store_true", help="also measure in chromium (streamlit run)")
    ap.add_argument(
        "--skip", default="", help="comma list of parts,apptest,preview to skip (preview: the parts' preview scores)"
    )
    ap.add_argument("--steps", type=int, default=1, help="browser: slider steps per change (default 1)")
    ap.add_argument("--pause", type=float, default=0.0, help="browser: seconds of idle page before each change")
    ap.add_argument(
        "--look-ahead",
        choices=("on", "off"),
        default=None,
        help="browser: the server's FEATCAL_LOOK_AHEAD (default: this environment's, on unless set)",
    )
    ap.add_argument("--live", type=int, default=None, help="test examples per task scored live (app: 50, LLM: 16)")
    ap.add_argument("--diag", type=int, default=None, help="held-out examples per task for drift (app: 16)")
    ap.add_argument(
        "--record",
        default=None,
        help="JSON file to add this n's accuracy gain and exact-run CPU seconds to (the Calibrate page reads "
        "assets/measured/demo_calibration_sizes.json)",
    )
    args = ap.parse_args()
    from app import compute, zoos

    if args.live:  # every zoo's live subset
        compute.LIVE_TEST = compute.LIVE_TEST_LM = args.live
    compute.DIAG_N = args.diag or compute.DIAG_N
    n = args.n or 16  # app.settings.DEFAULT_N (not imported: it needs streamlit)
    rows = []
    for name, bench in (("parts", bench_parts), ("apptest", bench_apptest), ("browser", bench_browser)):
        if name in args.skip or (name == "browser" and not args.browser):
            continue
        t0 = time.perf_counter()
        if name == "parts" and args.record:
            record = json.loads(Path(args.record).read_text()) if Path(args.record).is_file() else {}
            rows += bench(args.zoo, n, args.repeats, record)
            Path(args.record).write_text(json.dumps(dict(sorted(record.items(), key=lambda kv: int(kv[0]))), indent=1))
        elif name == "browser":
            look_ahead = None if args.look_ahead is None else args.look_ahead == "on"
            rows += bench(args.zoo, n, args.repeats, args.steps, args.pause, look_ahead)
        elif name == "parts":
            rows += bench(args.zoo, n, args.repeats, preview="preview" not in args.skip)
        else:
            rows += bench(args.zoo, n, args.repeats)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    print(
        f"\napp latency on zoo {args.zoo!r}, {n} calibration examples per task, "
        f"{compute.DIAG_N} held-out examples per task (the live test subset: in the table)"
    )
    print(_common.environment(zoos.device()))
    print(_common.markdown_table(rows))


if __name__ == "__main__":
    main()
