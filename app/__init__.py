"""The featcal Streamlit app (``streamlit run app/streamlit_app.py``): a thin view over
featcal and diagnostics. Layout in ``pages/``, caching in :mod:`app.state`, figures in
:mod:`app.figures`, library calls in :mod:`app.compute`."""
