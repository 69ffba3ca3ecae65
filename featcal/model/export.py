"""The files a model hub expects beside a model's weights, for every model featcal writes.

:func:`write_hub_files` is called by each writer (``featcal calibrate --out``, streamed or not,
``featcal merge --out``, the app's Export) inside the directory it is filling, after the
weights and ``config.json``:

- the tokenizer, chat template, generation and preprocessor configs, copied from the base
  model's directory (never over a file the writer already wrote);
- a model card, ``README.md``, whose YAML front matter says ``base_model``, ``tags: [merge,
  featcal]``, the merge and its parameters, the FeatCal settings, the calibration sizes, the
  scores and a drift summary (``huggingface_hub.ModelCard`` reads it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping

import yaml

CARD = "README.md"
MAX_SHARD_BYTES = 4 << 30  # the largest weight file featcal writes (hubs take up to 50 GB; 4-5 GB is usual)
# Files of a base model's directory that a merged model shares with it.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def hub_id(path: str | os.PathLike | None) -> str | None:
    """The Hugging Face id of a model directory, where it tells one: a hub cache snapshot
    (``models--ORG--NAME/snapshots/REV``) or a ``config.json`` with ``_name_or_path``."""
    if path is None:
        return None
    p = Path(path).expanduser().absolute()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.removeprefix("models--").replace("--", "/")
    cfg = p / "config.json"
    if cfg.is_file():
        name = json.loads(cfg.read_text()).get("_name_or_path") or ""
        if name and not Path(name).is_absolute() and name.count("/") == 1:
            return name
    return None


def model_name(path: str | os.PathLike) -> str:
    """How a card names a model directory: its hub id where known, else the directory's name (a
    card is for sharing; local absolute paths say nothing to its readers)."""
    return hub_id(path) or Path(path).name


def copy_base_files(base_dir: str | os.PathLike | None, out_dir: str | os.PathLike, replace: bool = False) -> list[str]:
    """Copy :data:`SIDE_FILES` the base has and ``out_dir`` lacks (``replace``: those it has too,
    and ``config.json``); returns their names."""
    if base_dir is None or not Path(base_dir).is_dir():
        return []
    copied = []
    for name in SIDE_FILES + (("config.json",) if replace else ()):
        src, dst = Path(base_dir) / name, Path(out_dir) / name
        if src.is_file() and (replace or not dst.exists()):
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def _plain(obj):
    """``obj`` with only YAML's plain types (numbers rounded to 4 significant digits)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    return str(obj)


def drift_summary(report) -> dict:
    """A :class:`~featcal.engine.report.CalibrationReport` (or its ``to_dict()``) in a few numbers:
    modules, blocks and the mean relative residual (the calibrated modules' output drift from
    the experts' targets) before and after."""
    mods = report["modules"] if isinstance(report, Mapping) else [vars(m) for m in report.modules]
    if not mods:
        return {"modules": 0}
    return {
        "modules": len(mods),
        "blocks": len({m["block"] for m in mods}),
        "mean_residual_before": sum(m["residual_before"] for m in mods) / len(mods),
        "mean_residual_after": sum(m["residual_after"] for m in mods) / len(mods),
    }


def model_card(
    *,
    name: str,
    base: str | None,
    experts: Mapping[str, str] | None = None,
    merge: Mapping | None = None,
    settings: Mapping | None = None,
    calibration: Mapping | None = None,
    scores: Mapping | None = None,
    drift: Mapping | None = None,
    preset: str | None = None,
) -> str:
    """The text of ``README.md``: YAML front matter (what a hub indexes) and a short body; the
    ``preset`` the settings came from (featcal.config.PRESETS) heads them."""
    if preset and settings:
        settings = {"preset": preset, **settings}
    featcal = {
        "merge": merge,
        "experts": experts,
        "settings": settings,
        "calibration": calibration,
        "scores": scores,
        "drift": drift,
    }
    front = {"base_model": base, "tags": ["merge", "featcal"], "library_name": "transformers"}
    front = {k: v for k, v in front.items() if v is not None}
    front["featcal"] = _plain({k: v for k, v in featcal.items() if v})
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {name}", ""]
    method = (merge or {}).get("method", "a merge")
    what = f"the FeatCal-calibrated {method} merge" if settings else f"the {method} merge"
    lines.append(f"This model is {what} of {len(experts or {})} experts" + (f" on `{base}`." if base else "."))
    if settings:
        lines += [
            "",
            "FeatCal (post-merging feature calibration, arXiv 2605.13030) replaced each calibrated",
            "Linear/LayerNorm of the merged model by a closed-form ridge solution that pulls its outputs",
            "toward the experts', anchored near the merged weights.",
        ]
    for title, part in (
        ("Experts", experts),
        ("Merge", merge),
        ("FeatCal settings", settings),
        ("Calibration data", calibration),
        ("Scores", scores),
        ("Drift", drift),
    ):
        if part:
            lines += ["", f"## {title}", "", "```yaml", yaml.safe_dump(_plain(part), sort_keys=False).rstrip(), "```"]
    lines += ["", "Written by featcal; the run's full record is in the report (JSON) beside this card.", ""]
    return "\n".join(lines)


def write_hub_files(out_dir: str | os.PathLike, *, base_dir: str | os.PathLike | None = None, **card) -> Path:
    """Copy the base's tokenizer/chat template/generation config into ``out_dir`` (those it
    lacks) and write the model card (:func:`model_card`'s keywords; ``name`` defaults to the
    directory's name, ``base`` to the base's hub id, else its directory name). Returns the card's path."""
    out_dir = Path(out_dir)
    copy_base_files(base_dir, out_dir)
    card.setdefault("name", out_dir.name)
    if card.get("base") is None and base_dir is not None:
        card["base"] = model_name(base_dir)
    (out_dir / CARD).write_text(model_card(**card))
    return out_dir / CARD
