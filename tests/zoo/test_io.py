"""featcal.zoo.io: safe saving (no overwrite without force, nothing half-written) and loading."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from featcal.zoo import io


def _tiny_clip(seed: int = 0):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        image_size=16, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return CLIPVisionModel(cfg).eval()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_hf_round_trip_and_marker(tmp_path):
    model = _tiny_clip()
    out = io.save_model(model, tmp_path / "m", fmt="hf", extra_files={"report.json": {"a": 1}})
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert io.read_marker(out)["format"] == "hf"
    assert json.loads((out / "report.json").read_text()) == {"a": 1}
    loaded = io.load_model(out)  # class from config.json
    assert type(loaded) is type(model) and _same_weights(loaded, model)


def test_torch_round_trip_needs_like(tmp_path):
    model = _mlp(0)
    out = io.save_model(model, tmp_path / "m", fmt="torch", config={"arch": "mlp"})
    assert io.read_marker(out) == {
        "format": "torch",
        "class": "torch.nn.modules.container.Sequential",
        "config": {"arch": "mlp"},
    }
    with pytest.raises(ValueError, match="like="):
        io.load_model(out)
    other = _mlp(1)
    loaded = io.load_model(out, like=other)
    assert _same_weights(loaded, model) and not _same_weights(other, model)  # `like` untouched


def test_refuses_to_overwrite_without_force(tmp_path):
    target = tmp_path / "m"
    io.save_model(_mlp(0), target, fmt="torch")
    before = (target / "model.safetensors").read_bytes()
    with pytest.raises(io.OutputExistsError, match="--force"):
        io.save_model(_mlp(1), target, fmt="torch")
    assert (target / "model.safetensors").read_bytes() == before
    io.save_model(_mlp(1), target, fmt="torch", force=True)
    assert (target / "model.safetensors").read_bytes() != before
    assert _siblings(target) == ["m"]  # no temporary or old directories left behind


def test_failed_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    model = _tiny_clip()

    def broken_save(out_dir, **kwargs):  # writes part of a model, then fails
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_model(model, tmp_path / "new", fmt="hf")
    assert _siblings(tmp_path / "new") == []

    # Replacing an existing model with force: the old one survives a failed write intact.
    old = io.save_model(_tiny_clip(1), tmp_path / "old", fmt="hf")
    files = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(OSError, match="disk full"):
        io.save_model(model, old, fmt="hf", force=True)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == files
    assert _siblings(old) == ["old"]


def test_failure_in_extra_files_rolls_back(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        io.save_model(_mlp(), tmp_path / "m", fmt="torch", extra_files={"../escape.json": {}})
    assert _siblings(tmp_path / "m") == []


def test_unknown_format_and_wrong_model(tmp_path):
    with pytest.raises(ValueError, match="unknown model format"):
        io.save_model(_mlp(), tmp_path / "m", fmt="onnx")
    with pytest.raises(ValueError, match="save_pretrained"):
        io.save_model(_mlp(), tmp_path / "m", fmt="hf")
    assert not (tmp_path / "m").exists()


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        io.load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no saved model"):
        io.load_model(tmp_path / "empty")


def test_legacy_state_dict_is_weights_only(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(io.load_legacy_state_dict(tmp_path / "ok.pt")["w"], torch.ones(2))
    torch.save({"obj": _Payload()}, tmp_path / "bad.pt")
    with pytest.raises(pickle.UnpicklingError):
        io.load_legacy_state_dict(tmp_path / "bad.pt")


class _Payload:  # an arbitrary object: weights_only loading must refuse it
    pass


def test_write_json_and_tree_hash(tmp_path):
    io.write_json(tmp_path / "a" / "x.json", {"k": [1, 2]})
    assert json.loads((tmp_path / "a" / "x.json").read_text()) == {"k": [1, 2]}
    assert _siblings(tmp_path / "a" / "x.json") == ["x.json"]
    digest, files = io.tree_sha256(tmp_path / "a")
    assert list(files) == ["x.json"]
    (tmp_path / "a" / "x.json").write_text("{}")
    assert io.tree_sha256(tmp_path / "a")[0] != digest


def test_saved_tree_has_plain_permissions(tmp_path):
    out = io.save_model(_tiny_clip(), tmp_path / "m", fmt="hf")
    umask = io._current_umask()
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0o700
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_zoo_loads_from_two_threads_run_one_after_the_other(monkeypatch):
    """A zoo load started while another runs (the app: a zoo picked while the first page's
    still loads) waits for it, through load_any and the Your-models check alike: two loads side
    by side imported transformers' lazy submodules from two threads, and the second failed on a
    cold start ("cannot import name 'AutoTokenizer' from 'transformers')."""
    import threading

    import featcal.zoo
    from featcal.zoo.load import from_spec
    from featcal.zoo.spec import parsing, userspec

    entered, active, most = threading.Event(), [0], [0]
    guard = threading.Lock()

    def slow_load(name):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        if name == "first":
            entered.set()
            threading.Event().wait(1.0)  # room for the second load to start beside this one
        with guard:
            active[0] -= 1
        return name

    monkeypatch.setattr(featcal.zoo, "load_demo", lambda **kw: slow_load("first"))
    monkeypatch.setattr(featcal.zoo, "_on", lambda zoo, device: zoo)
    monkeypatch.setattr(parsing, "from_dict", lambda spec, root, source: spec)
    monkeypatch.setattr(from_spec, "load", lambda spec, device: slow_load(spec))
    first = threading.Thread(target=featcal.zoo.load_any, args=("demo",))
    first.start()
    assert entered.wait(60)
    assert userspec.load_checked("second", "/nowhere/zoo.yaml") == "second"
    first.join(60)
    assert not first.is_alive() and most[0] == 1
