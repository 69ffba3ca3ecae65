"""How the app shows numbers: tables rounded and right-aligned with no "None", settings as a
small two-column table, the Calibrate page's five summary metrics. Pure functions of
DataFrames and dicts (no Streamlit), so they are tested on their own.
"""

from __future__ import annotations

import math

import pandas as pd
from pandas.io.formats.style import Styler

MISSING = "–"  # what an empty cell shows (never "None" or "nan")


def _is_float(series: pd.Series) -> bool:
    return pd.api.types.is_float_dtype(series)


def styled(df: pd.DataFrame, digits: int = 4, index: bool = True) -> Styler:
    """``df`` for ``st.dataframe``: floats with ``digits`` decimals, integers with thousands
    separators, missing cells as a dash (numbers keep their dtype, so they stay right-aligned
    and sort as numbers)."""
    formats = {}
    for col in df.columns:
        if _is_float(df[col]):
            formats[col] = f"{{:,.{digits}f}}"
        elif pd.api.types.is_integer_dtype(df[col]) and not pd.api.types.is_bool_dtype(df[col]):
            formats[col] = "{:,}"
    style = df.style.format(formats, na_rep=MISSING)
    if not index:
        style = style.hide(axis="index")
    return style


def dashed(df: pd.DataFrame, digits: int = 4) -> tuple[pd.DataFrame, list[str]]:
    """``df`` with every numeric column that has missing cells turned into text (rounded to
    ``digits``, thousands separated, a dash where missing; Streamlit shows a missing number as
    "None" whatever a Styler says), and the names of those columns (to right-align them)."""
    out, texts = df.copy(), []
    for col in df.columns:
        series = df[col]
        numeric = pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)
        if series.dtype == object and series.map(lambda v: v is None or isinstance(v, (int, float))).all():
            numeric = series.notna().any()
        if not numeric or not series.isna().any():
            continue
        values = pd.to_numeric(series, errors="coerce")
        whole = bool(((values.dropna() % 1) == 0).all()) and not pd.api.types.is_float_dtype(series)
        out[col] = [MISSING if pd.isna(v) else (f"{int(v):,}" if whole else f"{v:,.{digits}f}") for v in values]
        texts.append(col)
    return out, texts


def settings_table(settings: dict) -> pd.DataFrame:
    """A settings dict as a two-column table (``setting``, ``value``), values as short text:
    floats to 4 significant digits, None as a dash, sequences joined by commas."""

    def text(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return MISSING
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (list, tuple)):
            return ", ".join(text(x) for x in v) or MISSING
        if isinstance(v, dict):
            return ", ".join(f"{k}={text(x)}" for k, x in v.items()) or MISSING
        return str(v)

    return pd.DataFrame({"setting": list(settings), "value": [text(v) for v in settings.values()]})


def summary_metrics(before: pd.DataFrame, after: pd.DataFrame) -> list[tuple[str, str, str, bool]]:
    """The Calibrate page's five numbers from two ``app.compute.task_summary`` frames (the
    merged model's and the result's): ``(label, value, change, lower is better)`` each,
    means over tasks."""

    def pair(col: str) -> tuple[float, float]:
        return float(after[col].mean()), float(after[col].mean() - before[col].mean())

    acc, d_acc = pair("accuracy")
    cos, d_cos = pair("expert_cosine")
    tv, d_tv = pair("task_vector_cosine")
    kl, d_kl = pair("kl")
    agr, d_agr = pair("agreement")
    return [
        ("mean accuracy", f"{acc:.2f}%", f"{d_acc:+.2f} pp vs merged", False),
        ("expert cosine", f"{cos:.4f}", f"{d_cos:+.4f}", False),
        ("task-vector cosine", f"{tv:.4f}", f"{d_tv:+.4f}", False),
        ("KL(expert ‖ model)", f"{kl:.4f}", f"{d_kl:+.4f}", True),
        ("top-1 agreement", f"{agr:.2f}%", f"{d_agr:+.2f} pp", False),
    ]
