"""featcal app: ``streamlit run app/streamlit_app.py`` (opens on the embedded demo zoo).

1. ``st.navigation`` lists the pages by title (loaded lazily: only the open page runs). It
   comes first: until it is called, Streamlit's sidebar lists the files of ``pages/``;
2. the sidebar zoo picker loads the zoo (cached for every tab; a build shows its progress),
   or shows what is wrong;
3. the open page runs. Pages read the settings through :mod:`app.controls`, the zoo, models
   and tables through :mod:`app.state`.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # `from app import ...` under `streamlit run`

import streamlit as st

from app import binding

# 0. Served where the user did not ask (another directory's Streamlit config, no address):
# refuse before anything is loaded.
if (refused := binding.check(st)) is not None:
    st.set_page_config(page_title="featcal", layout="centered")
    st.error(refused)
    st.stop()

from app import ahead, controls, state, ui  # noqa: E402  (after the address check: nothing loaded before it)

caught = state.calibrations().warnings
caught.install()  # library warnings go to the sidebar's badge, not raw into the server's log

# (file, title, icon); tune and studies are other engineers' pages, listed when present.
PAGES = [
    ("zoo.py", "Zoo", ":material/inventory_2:"),
    ("drift.py", "Drift", ":material/stacked_line_chart:"),
    ("calibrate.py", "Calibrate", ":material/tune:"),
    ("weights.py", "Weights", ":material/grid_on:"),
    ("export.py", "Export", ":material/download:"),
    ("tune.py", "Tune", ":material/search:"),
    ("studies.py", "Studies", ":material/science:"),
    ("compare.py", "Compare", ":material/compare:"),
    ("generate.py", "Generate", ":material/chat:"),  # LLM zoos: one prompt, every model's reply
]

ICON = HERE / "icon.png"  # a local file: a ":material/...:" page icon makes the browser fetch it from Google
st.set_page_config(page_title="featcal", page_icon=str(ICON), layout="wide")

# 1. The pages.
pages = [
    st.Page(HERE / "pages" / f, title=title, icon=icon, default=(f == "zoo.py"))
    for f, title, icon in PAGES
    if (HERE / "pages" / f).is_file()
]
page = st.navigation(pages)

# 2. The zoo.
st.sidebar.title("featcal")
source = controls.zoo_picker()
st.set_page_config(page_title=f"{page.title} · {source or 'no zoo'} · featcal")  # the tab names the zoo loading
zoo, error = state.zoo_or_error(source)

# 3. The open page, once the zoo is there.
if error is not None:
    st.error(error)
    st.stop()
st.session_state["_zoo_source"] = source
st.set_page_config(page_title=f"{page.title} · {zoo.name} · featcal")
st.sidebar.caption(
    f"**{zoo.name}**: {len(zoo.tasks)} tasks, {zoo.fmt} format, on {state.device()}. "
    "Post-merging feature calibration, arXiv 2605.13030."
)
ahead.stop()  # a new run: the look-ahead of the last one (app.ahead) gives way
badge = st.sidebar.empty()
ui.library_warnings(badge, caught.recent())  # drawn before the page, which may stop early (st.stop)
page.run()
ui.library_warnings(badge, caught.recent())  # and again after it: this run's warnings too
