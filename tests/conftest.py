"""Shared fixtures. The tiny seeded models live in tests/tiny.py and the tiny zoo directory
writer in tests/app_zoo.py; both are importable from every test folder."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py and tests/app_zoo.py, from any layer's folder


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
