"""The featcal Streamlit app (``streamlit run app/streamlit_app.py``): a thin view over
featcal and diagnostics.

- ``pages/``: the layout, one file per page;
- :mod:`app.settings`: the settings as frozen values (merger, calibration, model references);
- :mod:`app.controls`: the URL-bound widgets that set them;
- :mod:`app.state`: the zoo, its models and result tables, cached across reruns and tabs;
- :mod:`app.calibrations`: the one server-wide service (no Streamlit) owning the exact runs, the
  previews, the threads the torch work runs on and the locks (docs/app.md); :mod:`app.runs`, its
  bookkeeping of runs; :mod:`app.ahead`, the look-ahead;
- :mod:`app.zoos`: the zoo (load, build, describe) and the CPU threads its work gets;
- :mod:`app.compute`: the calibration, its preview and the scores: the library calls, without Streamlit;
- :mod:`app.figures` (one module per topic), :mod:`app.ui`: figures from tables, a status line;
- :mod:`app.st_patch`: the one setting of a Streamlit internal, and why.
"""
