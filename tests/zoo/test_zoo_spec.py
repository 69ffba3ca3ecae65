"""Zoo specs: tiny random CLIPs and data written to temporary dirs, loaded offline end to end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_zero_shot import tiny_clip

from featcal.zoo.core import evaluate
from featcal.zoo.load import from_spec as zoo_spec
from featcal.zoo.load.data import LazySplits, split_indices, to_clip_input
from featcal.zoo.spec.resolve import MissingResourcesError

PRESETS = Path(__file__).resolve().parents[2] / "assets" / "zoos"
COLORS = [(220, 30, 30), (30, 200, 40), (40, 60, 220)]


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    """An empty HF cache of our own; HF_HUB_OFFLINE restored after each test."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _image(label: int, seed: int, size: int = 40) -> Image.Image:
    """A noisy image whose mean colour says its label (so the classes differ)."""
    rng = np.random.default_rng(seed)
    base = np.array(COLORS[label % 3], dtype=np.float32) * (1 + label // 3) / 4
    arr = np.clip(base + rng.normal(0, 40, (size, size + 8, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_image_folder(root: Path, classes: list[str], n_train: int, n_test: int) -> None:
    for split, n in (("train", n_train), ("test", n_test)):
        for k, c in enumerate(classes):
            (root / split / c).mkdir(parents=True)
            for j in range(n):
                _image(k, 1000 * k + j + (0 if split == "train" else 500)).save(root / split / c / f"{j}.png")


def write_npz(path: Path, n_classes: int, n_train: int, n_test: int) -> None:
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = np.arange(n) % n_classes
        arrays[f"{split}_inputs"] = np.stack([np.asarray(_image(int(y), 7 * i + n)) for i, y in enumerate(labels)])
        arrays[f"{split}_labels"] = labels
    np.savez(path, **arrays)


def _perturbed_vision(clip, seed: int, std: float = 0.05):
    """A CLIPVisionModel carrying ``clip``'s vision tower plus seeded noise (an "expert")."""
    from transformers import CLIPVisionModel

    vision = CLIPVisionModel(clip.config.vision_config).eval()
    own = {k.removeprefix("vision_model."): k for k in vision.state_dict()}
    src = clip.vision_model.state_dict()
    vision.load_state_dict({own[k]: v for k, v in src.items() if k in own})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in vision.parameters():
            p.add_(std * torch.randn(p.shape, generator=gen))
    return vision


def write_hf_cache_model(repo_id: str, files: dict[str, bytes | str]) -> Path:
    """Lay ``files`` out as the HF cache does (refs/main -> snapshots/<commit>)."""
    import os

    folder = Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = folder / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abcd")
    for name, data in files.items():
        (snap / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return snap


@pytest.fixture
def hf_zoo(tmp_path):
    """A tiny HF CLIP zoo on disk: base CLIPModel dir, one expert as a local save_pretrained dir,
    one in the HF cache with transformers-4.x key names; image-folder and npz data."""
    from safetensors.torch import save_file

    clip = tiny_clip(tmp_path / "base", seed=0)
    _perturbed_vision(clip, 1).save_pretrained(tmp_path / "expert_mnist")
    shapes = _perturbed_vision(clip, 2)
    nested = {f"vision_model.{k.removeprefix('vision_model.')}": v.contiguous() for k, v in shapes.state_dict().items()}
    blob = tmp_path / "w.safetensors"
    save_file(nested, str(blob))
    cfg = clip.config.vision_config.to_dict()
    cfg["model_type"] = "clip_vision_model"
    write_hf_cache_model(
        "tanganke/tiny-clip_shapes", {"config.json": json.dumps(cfg), "model.safetensors": blob.read_bytes()}
    )
    write_image_folder(tmp_path / "data" / "mnist", [str(d) for d in range(10)], n_train=2, n_test=2)
    write_npz(tmp_path / "data" / "shapes.npz", 3, n_train=18, n_test=9)
    spec = {
        "name": "tiny",
        "base": "base",
        "experts": {"mnist": "expert_mnist", "shapes": "tanganke/tiny-clip_shapes"},
        "heads": {
            "type": "zero_shot",
            "classes": {"shapes": ["red", "green", "blue"]},
            "templates": {"shapes": ["a {} picture.", "something {}."]},
        },
        "data": {"mnist": "${FEATCAL_TEST_DATA:-data}/mnist", "shapes": {"path": "data/shapes.npz"}},
        "splits": {"calib": 8, "val": 4, "seed": 3},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, clip


def test_hf_spec_loads_merges_calibrates_and_evaluates(hf_zoo):
    from transformers import CLIPVisionModel

    from featcal import FeatCalConfig, calibrate

    path, clip = hf_zoo
    zoo = zoo_spec.load(path)
    assert zoo.name == "tiny" and zoo.fmt == "hf" and zoo.tasks == ["mnist", "shapes"]
    assert all(isinstance(m, CLIPVisionModel) for m in [zoo.base, *zoo.experts.values()])
    assert zoo.data["shapes"].classes == ["red", "green", "blue"] and len(zoo.data["mnist"].classes) == 10
    # Zero-shot heads: unit-norm rows times CLIP's logit scale, no bias.
    scale = float(clip.logit_scale.detach().exp())
    for head in zoo.heads.values():
        assert head.bias is None
        torch.testing.assert_close(head.weight.norm(dim=-1), torch.full((head.out_features,), scale))
    x, y = zoo.split("mnist", "test")
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.float32
    assert y.tolist() == [d for d in range(10) for _ in (0, 1)]
    feats = zoo.features(zoo.base, x[:4])
    torch.testing.assert_close(feats.norm(dim=-1), torch.ones(4))

    merged = zoo.merged("task_arithmetic", scale=0.3)
    calib = zoo.calib_data(8)
    assert {t: sum(len(b) for b in bs) for t, bs in calib.items()} == {"mnist": 8, "shapes": 8}
    calibrated, report = calibrate(
        merged, base=zoo.base, experts=zoo.experts, calib_data=calib, config=FeatCalConfig(), progress=False
    )
    assert report is not None and calibrated is not merged
    for model in (zoo.base, merged, calibrated, *zoo.experts.values()):
        acc = evaluate(model, zoo)
        assert set(acc) == {"mnist", "shapes"} and all(0.0 <= a <= 100.0 for a in acc.values())


def test_splits_are_lazy_seeded_and_disjoint(hf_zoo):
    path, _ = hf_zoo
    zoo = zoo_spec.load(path)
    splits = zoo.data["shapes"].splits
    assert isinstance(splits, LazySplits) and splits.loaded() == []
    assert sorted(splits) == ["calib", "test", "val"]
    xc, yc = zoo.split("shapes", "calib")
    xv, _ = zoo.split("shapes", "val")
    assert splits.loaded() == ["calib", "val"] and len(xc) == 8 and len(xv) == 4
    rows = {tuple(r.flatten()[:64].tolist()) for r in torch.cat([xc, xv])}
    assert len(rows) == 12  # calib and val never share an example
    again = zoo_spec.load(path).split("shapes", "calib")
    torch.testing.assert_close(again[0], xc)
    assert torch.equal(again[1], yc)
    with pytest.raises(KeyError, match="has no split 'train'"):
        zoo.split("shapes", "train")
    idx = split_indices(100, 50, calib=10, val=5, test=20, seed=0)
    assert not set(idx["calib"]) & set(idx["val"]) and len(idx["test"]) == 20
    assert split_indices(100, 50, 10, 5, 20, seed=0) == idx != split_indices(100, 50, 10, 5, 20, seed=1)
    with pytest.raises(ValueError, match="lower splits.calib"):
        split_indices(10, 5, calib=8, val=4, test=None, seed=0)


def test_missing_things_are_listed_in_one_error(tmp_path, monkeypatch):
    tiny_clip(tmp_path / "base")
    write_npz(tmp_path / "ok.npz", 3, 6, 3)
    spec = {
        "base": "base",
        "experts": {"a": "tanganke/clip-vit-base-patch32_gone", "b": "./experts/b", "c": "base"},
        "heads": {"type": "file", "path": "heads.safetensors"},
        "data": {"a": "ok.npz", "b": {"path": "${NO_SUCH_ROOT:-nowhere}/b", "hub": "tanganke/b_data"}, "c": "ok.npz"},
    }
    path = tmp_path / "z.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setattr("featcal.zoo.load.loaders.load_models", lambda *a, **k: pytest.fail("loaded before checking"))
    with pytest.raises(MissingResourcesError) as info:
        zoo_spec.load(path)
    msg = str(info.value)
    hub = tmp_path / "hf" / "hub"
    assert "4 thing(s)" in msg and len(info.value.missing) == 4
    assert "expert 'a': HF model tanganke/clip-vit-base-patch32_gone" in msg
    assert f"HF cache {hub / 'models--tanganke--clip-vit-base-patch32_gone'} (not there)" in msg
    assert "huggingface-cli download tanganke/clip-vit-base-patch32_gone" in msg and "HF_HOME" in msg
    assert f"local path {tmp_path / 'experts' / 'b'} (does not exist)" in msg
    assert f"local path {tmp_path / 'nowhere' / 'b'}" in msg and str(hub / "datasets--tanganke--b_data") in msg
    assert "--repo-type dataset" in msg and "heads file" in msg
    assert [m.what for m in zoo_spec.check(path)] == [m.what for m in info.value.missing]


def test_presets_parse_and_report_everything_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_DATA", str(tmp_path / "data"))
    for arch, patch in (("b32", "base-patch32"), ("b16", "base-patch16"), ("l14", "large-patch14")):
        spec = zoo_spec.parse(PRESETS / f"clip-vit-{arch}-ta8.yaml")
        assert spec.tasks == ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
        assert spec.base.id == f"openai/clip-vit-{patch}"
        assert spec.experts["stanford-cars"].id == f"tanganke/clip-vit-{patch}_stanford-cars"
        assert spec.data["dtd"].path == str(tmp_path / "data" / "dtd") and spec.splits.calib == 256
        missing = zoo_spec.check(spec)
        assert len(missing) == 17  # base, 8 experts, 8 datasets: all in one list
    with pytest.raises(MissingResourcesError, match="tanganke/clip-vit-large-patch14_gtsrb"):
        zoo_spec.load(spec)


def test_spec_errors_name_the_key(tmp_path, monkeypatch):
    def parse(d):
        return zoo_spec.from_dict(d, root=tmp_path, source="z.yaml")

    ok = {"base": "b", "experts": {"mnist": "e"}, "data": {"mnist": "d"}}
    parse(ok)
    with pytest.raises(zoo_spec.SpecError, match=r"z.yaml: top level: unknown key\(s\) \['expert'\]"):
        parse({**ok, "expert": {}})
    with pytest.raises(zoo_spec.SpecError, match="no data for \\['mnist'\\]"):
        parse({**ok, "data": {"svhn": "d"}})
    with pytest.raises(zoo_spec.SpecError, match="heads.classes.*'toy'"):
        parse({**ok, "experts": {"toy": "e"}, "data": {"toy": "d"}})
    with pytest.raises(zoo_spec.SpecError, match="splits.calib"):
        parse({**ok, "splits": {"calib": 0}})
    with pytest.raises(zoo_spec.SpecError, match="NOT_SET_ANYWHERE is not set"):
        parse({**ok, "data": {"mnist": "$NOT_SET_ANYWHERE/x"}})
    with pytest.raises(zoo_spec.SpecError, match="open_clip model needs `arch`"):
        parse({**ok, "format": "open_clip"})
    monkeypatch.setenv("ROOT_X", "/r")
    assert zoo_spec.expand("${ROOT_X}/a:${UNSET_Y:-~/b}") == "/r/a:" + str(Path("~/b").expanduser())
    spec = parse({**ok, "base": "openai/clip-vit-base-patch32", "experts": {"mnist": {"path": "e"}}})
    assert spec.base.id == "openai/clip-vit-base-patch32" and spec.experts["mnist"].path == str(tmp_path / "e")


def test_parquet_arrow_and_file_heads(tmp_path):
    """Data from HF-cache parquet files and a save_to_disk directory, with linear heads from a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import save_file

    clip = tiny_clip(tmp_path / "base")
    _perturbed_vision(clip, 1).save_pretrained(tmp_path / "e1")
    _perturbed_vision(clip, 2).save_pretrained(tmp_path / "e2")
    names = ["red", "green", "blue"]
    hf_meta = {
        b"huggingface": json.dumps(
            {"info": {"features": {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}}}
        ).encode()
    }

    def table(n: int, seed: int):
        labels = [i % 3 for i in range(n)]
        imgs = [{"bytes": _png(_image(y, seed + i)), "path": None} for i, y in enumerate(labels)]
        return pa.table({"image": imgs, "label": labels}).replace_schema_metadata(hf_meta)

    snap = write_hf_cache_model("x", {})  # make the hub folder, then move it to a dataset repo
    ds = tmp_path / "hf" / "hub" / "datasets--org--colors"
    snap.parent.parent.rename(ds)
    (ds / "snapshots" / "0123abcd" / "data").mkdir()
    pq.write_table(
        table(12, 0), ds / "snapshots" / "0123abcd" / "data" / "train-00000-of-00001.parquet", row_group_size=5
    )
    pq.write_table(table(6, 100), ds / "snapshots" / "0123abcd" / "data" / "test-00000-of-00001.parquet")
    arrow = tmp_path / "arrow_ds"
    for split, n in (("train", 9), ("test", 6)):
        (arrow / split).mkdir(parents=True)
        with pa.OSFile(str(arrow / split / "data-00000-of-00001.arrow"), "wb") as sink:
            t = table(n, 50)
            with pa.ipc.new_stream(sink, t.schema) as writer:
                writer.write_table(t)
        files = [{"filename": "data-00000-of-00001.arrow"}]
        (arrow / split / "state.json").write_text(json.dumps({"_data_files": files}))
        (arrow / split / "dataset_info.json").write_text(json.dumps({"features": {"label": {"names": names}}}))
    (arrow / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            "colors.weight": torch.randn(3, 16, generator=gen),
            "colors.bias": torch.zeros(3),
            "arrows.weight": torch.randn(3, 16, generator=gen),
        },
        str(tmp_path / "heads.safetensors"),
    )
    spec = {
        "base": "base",
        "experts": {"colors": "e1", "arrows": "e2"},
        "heads": {"type": "file", "path": "heads.safetensors"},
        "data": {"colors": {"path": "missing_here", "hub": "org/colors"}, "arrows": "arrow_ds"},
        "splits": {"calib": 4, "val": 2, "test": 4, "seed": 0},
    }
    (tmp_path / "z.yaml").write_text(yaml.safe_dump(spec))
    zoo = zoo_spec.load(tmp_path / "z.yaml")
    assert zoo.data["colors"].classes == names == zoo.data["arrows"].classes
    assert zoo.heads["colors"].bias is not None and zoo.heads["arrows"].bias is None
    x, y = zoo.split("colors", "calib")
    assert x.shape == (4, 3, 32, 32) and set(y.tolist()) <= {0, 1, 2}
    assert len(zoo.split("arrows", "test")[0]) == 4 and len(zoo.split("colors", "val")[0]) == 2
    assert set(evaluate(zoo.merged("average"), zoo)) == {"colors", "arrows"}


def test_to_clip_input_resizes_short_side_and_center_crops():
    img = Image.new("RGB", (60, 30))
    img.paste((255, 0, 0), (0, 0, 15, 30))  # left quarter red: cropped away
    img.paste((0, 0, 255), (15, 0, 45, 30))  # middle half blue: kept
    out = to_clip_input(img, 16)
    assert out.shape == (3, 16, 16) and out.dtype == torch.uint8
    assert out[2].float().mean() > 250 and out[0].float().mean() < 5


def test_open_clip_spec_loads(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    import tiny

    clip, _ = tiny.tiny_open_clip_clip(tmp_path, "tiny-oc-spec")
    save_file({k: v.contiguous() for k, v in clip.state_dict().items()}, str(tmp_path / "base.safetensors"))
    for i, task in enumerate(("mnist", "shapes")):
        gen = torch.Generator().manual_seed(i + 1)
        sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in clip.visual.state_dict().items()}
        if task == "mnist":  # a visual-only safetensors checkpoint
            save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "mnist.safetensors"))
        else:  # a torch.save'd wrapper around a prefixed state dict
            torch.save({"state_dict": {f"model.visual.{k}": v for k, v in sd.items()}}, tmp_path / "shapes.pt")
    write_npz(tmp_path / "mnist.npz", 10, 20, 10)
    write_npz(tmp_path / "shapes.npz", 3, 15, 6)
    spec = {
        "format": "open_clip",
        "arch": "tiny-oc-spec",
        "config": "tiny-oc-spec.json",
        "base": "base.safetensors",
        "experts": {"mnist": "mnist.safetensors", "shapes": {"path": "shapes.pt"}},
        "heads": {"classes": {"shapes": ["red", "green", "blue"]}},
        "data": {"mnist": "mnist.npz", "shapes": "shapes.npz"},
        "splits": {"calib": 6, "val": 2},
    }
    (tmp_path / "oc.yaml").write_text(yaml.safe_dump(spec))
    zoo = zoo_spec.load(tmp_path / "oc.yaml")
    assert zoo.fmt == "open_clip"
    assert all(isinstance(m, open_clip.transformer.VisionTransformer) for m in [zoo.base, *zoo.experts.values()])
    torch.testing.assert_close(zoo.base.state_dict()["proj"], clip.visual.proj.detach())
    x, _ = zoo.split("shapes", "test")
    with torch.no_grad():
        ref = torch.nn.functional.normalize(clip.encode_image(x), dim=-1)
    torch.testing.assert_close(zoo.features(zoo.base, x), ref, atol=1e-5, rtol=1e-5)
    assert set(evaluate(zoo.merged("task_arithmetic", scale=0.3), zoo)) == {"mnist", "shapes"}


def test_open_clip_pretrained_tag_is_read_from_the_hf_cache_only(tmp_path):
    pytest.importorskip("open_clip")
    from featcal.zoo.load.loaders import open_clip_quick_gelu
    from featcal.zoo.spec.locate import locate_model

    entry = zoo_spec.from_dict(
        {
            "format": "open_clip",
            "arch": "ViT-B-32",
            "base": {"pretrained": "openai"},
            "experts": {"mnist": "e.pt"},
            "data": {"mnist": "d"},
        },
        root=tmp_path,
    ).base
    assert open_clip_quick_gelu(entry)  # OpenAI weights need QuickGELU
    path, miss = locate_model(entry, "base")
    assert path is None and "models--timm--vit_base_patch32_clip_224.openai" in miss.looked[0]
    snap = write_hf_cache_model("timm/vit_base_patch32_clip_224.openai", {"open_clip_model.safetensors": b"x"})
    path, miss = locate_model(entry, "base")
    assert miss is None and path == snap / "open_clip_model.safetensors"
    bad = zoo_spec.from_dict(
        {
            "format": "open_clip",
            "arch": "ViT-B-32",
            "base": {"pretrained": "nope"},
            "experts": {"mnist": "e.pt"},
            "data": {"mnist": "d"},
        },
        root=tmp_path,
    ).base
    assert "openai" in locate_model(bad, "base")[1].fix
