"""The one place the app sets a Streamlit internal, and why.

Streamlit (1.67) runs a page file on its own, in its "pages/ directory" mode kept for
old apps, when a server's very first run starts at a page URL (a shared link, a
reload): ``st.navigation`` switches that mode off only once the main script has run.
Such a run never passes through the main script, so it has no zoo; the app switches
the mode off itself and reruns (:func:`app.state.active_source`).
"""

from __future__ import annotations


def leave_pages_directory_mode() -> None:
    """Make the next rerun go through the main script (``streamlit_app.py``)."""
    from streamlit.runtime.pages_manager import PagesManager

    PagesManager.uses_pages_directory = False
