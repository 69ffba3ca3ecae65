"""The Zoo page's Your models form under AppTest (issue 40): it ends in a zoo that loads, with
its preset named, or in a refusal shown whole that says what to change (a field of the form, or
the featcal calibrate command for a Llama-family base); nothing is written before the zoo loads."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from test_app import _app, _ok

ZOO_TESTS = str(Path(__file__).resolve().parents[1] / "zoo")


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(ZOO_TESTS)  # the zoo tests' tiny models
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _press(name: str, root: Path, **fields):
    """The app after filling the form (base, data, experts from ``root``; ``fields``: other keys'
    values) and pressing its button."""
    at = _app().run()
    at.text_input(key="yours_name").input(name)
    for key in ("base", "data", "experts"):
        at.text_input(key=f"yours_{key}").input(str(root / key))
    for key, value in fields.items():
        (at.selectbox if key == "features" else at.text_input)(key=f"yours_{key}").set_value(value)
    next(b for b in at.button if "zoo YAML" in b.label).click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _written(env, name: str) -> Path:
    return env / "cache" / "zoos" / "yours" / f"{name}.yaml"


def test_a_clip_vision_base_is_refused_until_features_pooled_and_a_heads_file(env):
    from test_userspec_checks import write_vision_models

    root = write_vision_models(env / "vis")
    at = _press("tiny-vis", root)
    (error,) = [e.value for e in at.error]
    assert "visual\\_projection" in error and "features: pooled" in error and "Nothing was written" in error
    assert not _written(env, "tiny-vis").exists() and "_yours_written" not in at.session_state
    at = _press("tiny-vis", root, features="pooled", heads=str(root / "heads.safetensors"))
    assert not at.error, [e.value for e in at.error]
    assert _written(env, "tiny-vis").is_file()
    assert any("Preset **clip**" in s.value for s in at.success), [s.value for s in at.success]
    at = _ok(_app(str(_written(env, "tiny-vis"))).run())
    assert "Zoo · tiny-vis" in [t.value for t in at.title]


def test_a_clip_model_base_is_written_with_its_preset(env):
    from test_userspec import write_user_models

    at = _press("tiny-mine", write_user_models(env / "mine"))
    assert not at.error and _written(env, "tiny-mine").is_file()
    (ok,) = [s.value for s in at.success]
    assert "Preset **clip**" in ok and "Calibrate page starts from it" in ok


@pytest.mark.parametrize("dense", [False, True], ids=["peft-adapter", "dense-no-tokenizer"])
def test_a_llama_base_gets_the_command_that_calibrates_it(env, dense):
    from test_userspec_checks import write_llama_models

    root = write_llama_models(env / "llama", dense=dense)
    at = _press("tiny-llama", root)
    (error,) = [e.value for e in at.error]
    assert "generative language model" in error and "another architecture" not in error
    assert "sentencepiece" not in error and "tiktoken" not in error
    (command,) = [c.value for c in at.code]
    assert command.startswith("featcal calibrate --base ") and "--expert code=" in command
    assert not _written(env, "tiny-llama").exists()
