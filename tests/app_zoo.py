"""A tiny zoo directory for the app tests: HF CLIPVisionModels (2 blocks, width 32),
three tasks of random 16x16 images, seeded. Written with featcal.zoo.store, so the
app loads it through the same path as any zoo directory (milliseconds to build)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

TASKS = ("alpha", "beta", "gamma")


def write_tiny_zoo(path: str | Path, seed: int = 0) -> Path:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from featcal.zoo.store import write_zoo_dir

    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    base = CLIPVisionModel(cfg).eval()
    experts, heads, arrays, classes = {}, {}, {}, {}
    rng = np.random.default_rng(seed)
    for i, task in enumerate(TASKS):
        gen = torch.Generator().manual_seed(seed + 10 + i)
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * ((float(p.std()) if p.numel() > 1 else 0.0) or 1.0) * torch.randn(p.shape, generator=gen))
        experts[task] = expert.eval()
        head = nn.Linear(32, 4)
        heads[task] = head.requires_grad_(False).eval()
        classes[task] = [f"{task}{k}" for k in range(4)]
        arrays[task] = {
            s: (rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), rng.integers(0, 4, n))
            for s, n in (("calib", 64), ("val", 32), ("test", 48))
        }
    return write_zoo_dir(
        path,
        name="tiny",
        base=base,
        experts=experts,
        heads=heads,
        arrays=arrays,
        classes=classes,
        features="pooler_output",
    )


def app_page_on_tiny_zoo(tmp_path: Path, page: str):
    """An ``AppTest`` of the app switched to ``page`` (e.g. ``pages/tune.py``) on a tiny zoo
    written to ``tmp_path``; asserts that the page ran without errors."""
    from streamlit.testing.v1 import AppTest

    zoo = write_tiny_zoo(Path(tmp_path) / "tiny")
    app = Path(__file__).resolve().parent.parent / "app" / "streamlit_app.py"
    at = AppTest.from_file(str(app), default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = str(zoo)
    at.run()
    at.switch_page(page).run()
    assert not at.exception and not at.error
    return at
