"""featcal.util.threads: the default torch CPU threads, from the model's size and the machine's load."""

import pytest
from torch import nn

from featcal.util import threads


def test_small_models_get_one_thread_whatever_the_machine():
    assert threads.choose_threads(1_000_000, cores=16, load=0.0) == 1


def test_big_models_get_the_cores_the_load_leaves_free():
    big = 10 * threads.SMALL_MODEL
    assert threads.choose_threads(big, cores=8, load=0.0) == 8
    assert threads.choose_threads(big, cores=8, load=3.2) == 5
    assert threads.choose_threads(big, cores=2, load=7.0) == 1  # busy: never oversubscribe, never 0
    assert threads.choose_threads(None, cores=4, load=1.0) == 3  # size unknown: as a big model


def test_a_process_does_not_count_its_own_work_as_load(monkeypatch):
    assert threads.own_load(cpu_seconds=30.0, age=20.0) == 0.5  # younger than the window: over the window
    assert threads.own_load(cpu_seconds=240.0, age=120.0) == 2.0  # older: over its life
    monkeypatch.setattr(threads, "load_average", lambda: 0.2)
    assert 0.0 <= threads.others_load() <= 0.2  # never below 0, never above the load


def test_default_threads_reads_the_model_the_env_and_the_device(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)
    assert threads.default_threads(nn.Linear(8, 8)) == 1
    assert threads.default_threads(None) == 4
    assert threads.default_threads(None, device="cuda:0") == 1
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.default_threads(nn.Linear(8, 8)) == 3
    monkeypatch.setenv(threads.ENV, "many")
    with pytest.raises(ValueError, match="FEATCAL_THREADS"):
        threads.default_threads()


def test_cli_threads_option_takes_auto_or_a_positive_number():
    import argparse

    from featcal.cli.common import add_common

    p = argparse.ArgumentParser()
    add_common(p)
    assert p.parse_args([]).threads == "auto"
    assert p.parse_args(["--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--threads", "0"])


def test_apply_threads_auto_waits_for_the_model(monkeypatch):
    import argparse

    import torch

    from featcal.cli.common import apply_threads

    monkeypatch.delenv(threads.ENV, raising=False)
    before = torch.get_num_threads()
    try:
        args = argparse.Namespace(threads="auto", device="cpu")
        assert apply_threads(args) is None
        assert apply_threads(args, nn.Linear(4, 4)) == 1 and torch.get_num_threads() == 1
        assert apply_threads(argparse.Namespace(threads=2, device="cpu")) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
