"""No file runs code (issue 24, item 4): a zoo directory whose meta.json asks for
trust_remote_code and whose config.json's auto_map points at its own Python file is refused,
by the loader and the command line, and the file never runs; a streamed checkpoint with an
auto_map is refused unless the user passes the flag."""

import json
import shutil

import pytest

from featcal.cli import commands as cli
from featcal.model.checkpoints import Checkpoint
from featcal.model.skeletons import skeleton
from featcal.zoo import load_any
from featcal.zoo.io import tree_sha256

EVIL = """
import pathlib
pathlib.Path({sentinel!r}).write_text("ran")
from transformers import CLIPVisionConfig, CLIPVisionModel


class EvilConfig(CLIPVisionConfig):
    model_type = "evil"


class EvilModel(CLIPVisionModel):
    config_class = EvilConfig
"""


def _plant(model_dir, sentinel) -> None:
    """The directory's own code, wired into its config.json as transformers' auto_map."""
    (model_dir / "evil.py").write_text(EVIL.format(sentinel=str(sentinel)))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    cfg["model_type"] = "evil"
    cfg["architectures"] = ["EvilModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def hostile_zoo(tmp_path, tiny_zoo_dir):
    zoo = tmp_path / "zoo"
    shutil.copytree(tiny_zoo_dir, zoo)
    sentinel = tmp_path / "SENTINEL"
    for d in [zoo / "base", *(zoo / "experts").iterdir()]:
        _plant(d, sentinel)
    meta = json.loads((zoo / "meta.json").read_text())
    meta["model_class"] = "AutoModel"
    meta["model_kwargs"] = {"trust_remote_code": True}
    # the hash lives in the same file, so a hostile zoo simply records the right one
    meta["content_sha256"], meta["files"] = tree_sha256(zoo, exclude=("meta.json", ".featcal-output.json"))
    (zoo / "meta.json").write_text(json.dumps(meta))
    return zoo, sentinel


def test_zoo_asking_for_remote_code_is_refused_without_running_it(hostile_zoo, capsys):
    zoo, sentinel = hostile_zoo
    with pytest.raises(ValueError, match="model_class|trust_remote_code"):
        load_any(str(zoo), progress=False)
    assert not sentinel.exists()
    assert cli.main(["zoo", "info", "--zoo", str(zoo), "-q"]) == 2
    assert "featcal: error:" in capsys.readouterr().err
    assert not sentinel.exists()


def test_zoo_kwargs_pass_an_allow_list(hostile_zoo):
    zoo, sentinel = hostile_zoo
    meta = json.loads((zoo / "meta.json").read_text())
    meta["model_class"] = "CLIPVisionModel"  # a library class, but the kwargs still ask for the code
    (zoo / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_any(str(zoo), progress=False)
    assert not sentinel.exists()


def test_streamed_checkpoint_with_auto_map_needs_the_flag(tmp_path, tiny_zoo_dir):
    model = tmp_path / "model"
    shutil.copytree(f"{tiny_zoo_dir}/base", model)
    sentinel = tmp_path / "SENTINEL"
    _plant(model, sentinel)
    with pytest.raises(ValueError, match="--trust-remote-code"):
        skeleton(Checkpoint(model, "the base"))
    assert not sentinel.exists()
