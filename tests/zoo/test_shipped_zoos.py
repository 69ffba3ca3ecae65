"""The CLIP zoo specs featcal ships (assets/zoos/clip-*.yaml): each parses; the TALL14 / TALL20 ones have
their 14 / 20 tasks, every task's class names built in, and FusionBench's experts. (The generative ones,
FLAN-T5 and MergeBench: tests/zoo/test_generative_zoos.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from featcal.zoo.load import classnames
from featcal.zoo.spec.parsing import from_dict

ZOOS = Path(__file__).resolve().parents[2] / "assets" / "zoos"


@pytest.mark.parametrize("path", sorted(ZOOS.glob("clip-*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_spec_parses(path):
    import yaml

    spec = from_dict(yaml.safe_load(path.read_text()), root=ZOOS, source=str(path))
    assert spec.name == path.stem
    n = int(path.stem.rsplit("tall", 1)[1]) if "tall" in path.stem else 8
    assert len(spec.experts) == n
    for task in spec.experts:
        classes, templates = classnames.classes_and_templates(task)
        assert classes and templates, task
    size = {"b32": "base-patch32", "b16": "base-patch16", "l14": "large-patch14"}[path.stem.split("-")[2]]
    assert all(f"tanganke/clip-vit-{size}_{t}" == spec.experts[t].id for t in spec.experts)
