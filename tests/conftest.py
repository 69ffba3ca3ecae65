"""Shared fixtures. The tiny seeded models live in tests/tiny.py and the tiny zoo directory
writer in tests/app_zoo.py; both are importable from every test folder."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py and tests/app_zoo.py, from any layer's folder
# The app's look-ahead (app/ahead.py) computes in the background after each result: off in the
# tests (and the servers they start), which then see one script run's work; its own tests turn it on.
os.environ.setdefault("FEATCAL_LOOK_AHEAD", "0")


@pytest.fixture(scope="session")
def tiny_zoo_dir(tmp_path_factory) -> str:
    """A tiny zoo saved in the demo zoo's directory format, written once per test session
    (tests only read it: the app, the CLI and the zoo store all load it)."""
    from app_zoo import write_tiny_zoo

    return str(write_tiny_zoo(tmp_path_factory.mktemp("zoo") / "tiny"))


@pytest.fixture(params=["toy", "hf_clip", "open_clip"])
def tiny_kind(request) -> str:
    """Each tiny architecture of tests/tiny.py in turn (toy blocks, HF CLIP, open_clip ViT)."""
    return request.param


@pytest.fixture(scope="session")
def smollm2_micro_dir(tmp_path_factory) -> str:
    """The SmolLM2 LLM zoo's micro build (two real blocks, two tasks, two LoRA steps per expert),
    written once per session; skipped, with the install commands, where its packages are absent."""
    from featcal.zoo.builtin import smollm2

    missing = smollm2.missing_packages()
    if missing:
        pytest.skip("smollm2 zoo packages missing: " + "; ".join(cmd for _, cmd in missing))
    return smollm2.build_smollm2(
        tmp_path_factory.mktemp("llm") / "micro", smollm2.micro_recipe(), progress=False, threads=1
    )


_DIFFERENTIAL: dict[str, dict] = {}


@pytest.fixture(scope="session")
def differential_tables() -> dict:
    """``{title: {outcome: count}}`` of the differential suites (featcal against mergekit, peft),
    printed at the end of the run so CI's log carries them."""
    return _DIFFERENTIAL


def pytest_terminal_summary(terminalreporter):
    for title, counts in _DIFFERENTIAL.items():
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(" | ".join(f"{k}: {v}" for k, v in counts.items()))
