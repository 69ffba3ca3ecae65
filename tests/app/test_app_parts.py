"""The app's parts without Streamlit's AppTest: the settings as frozen values and model
references, and the library calls of :mod:`app.compute` and :mod:`app.zoos` against diagnostics'
own tables. The figures: tests/app/test_app_figures.py; the pages: tests/app/test_app.py."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("streamlit")


# ----------------------------------------------------------------------------- settings (pure)


def test_widget_values_become_the_featcal_config():
    from app.settings import AppCal
    from featcal import FeatCalConfig

    cal = AppCal.from_widgets(log_lam=-1.3, rho=1.5, alpha=0.45, n=16, bias=False, layernorm=True)
    assert cal.config.lam == 0.05 and cal.n == 16  # the paper's λ exactly (10^-1.3 = 0.0501...)
    assert cal.config == FeatCalConfig.clip(lam=0.05, rho=1.5, alpha=0.45, bias=False, layernorm=True)
    assert cal.config.token_weights is not None  # the CLIP preset's, as before
    assert AppCal.from_widgets(-1.2999999999999998, 1.5, 0.45, 16, False, True) == cal  # one cache entry
    assert "λ=0.05," in cal.label and "n=16/task" in cal.label and "bias" not in cal.label
    with pytest.raises(ValueError, match="lam"):
        AppCal.from_widgets(float("nan"), 1.5, 0.45, 16, False, True)


def test_llm_zoos_take_their_architectures_preset_and_every_other_zoo_clips():
    """The widgets' defaults and config follow the zoo's preset: the CLIP one (token weights) as
    before on every zoo but language models, whose Llama-family setting has none."""
    from app.settings import AppCal, cal_defaults
    from featcal import FeatCalConfig

    assert cal_defaults("clip") == dict(log_lam=-1.3, rho=2.0, alpha=0.3, n_cal=16, bias=True, layernorm=True)
    llama = cal_defaults("llama-3b")
    assert llama == dict(log_lam=-5.0, rho=0.5, alpha=0.15, n_cal=16, bias=True, layernorm=False)
    cal = AppCal.from_widgets(**{k: v for k, v in llama.items() if k != "n_cal"}, n=16, preset="llama-3b")
    # in float64, as the table: at lam 1e-5 float32 statistics fall back to slower, inexact solves
    assert cal.config == FeatCalConfig.llama("3b", stats_dtype=torch.float64) and cal.config.token_weights is None
    assert AppCal.from_widgets(-1.3, 2.0, 0.3, 16, True, True).config.stats_dtype == torch.float32  # CLIP


def test_the_zoos_preset_is_clip_unless_it_is_a_language_model(tiny_zoo_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from app import zoos
    from featcal.config import preset_for_zoo

    assert preset_for_zoo(zoos.load_zoo(tiny_zoo_dir, "cpu")) == "clip"
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    assert preset_for_zoo(type("Zoo", (), {"base": LlamaForCausalLM(cfg)})()) == "llama-3b"


def _cal(log_lam=-1.3, rho=2.0, alpha=0.3, n=8, bias=True):
    from app.settings import AppCal

    return AppCal.from_widgets(log_lam, rho, alpha, n, bias, layernorm=True)


def _refs() -> list:
    """One reference per model the app can show, each differing from another in one setting."""
    from app.settings import Merger, ModelRef

    ta, ta4 = Merger("task_arithmetic", (("scale", 0.3),)), Merger("task_arithmetic", (("scale", 0.4),))
    ties = Merger("ties", (("density", 0.5), ("scale", 0.3)))
    cal, others = _cal(), [_cal(log_lam=-1.2), _cal(rho=1.5), _cal(alpha=0.35), _cal(n=16), _cal(bias=False)]
    return [
        ModelRef.base_model(),
        ModelRef.merged(ta),
        ModelRef.merged(ta4),
        ModelRef.merged(ties),
        ModelRef.calibrated(ta, cal),
        ModelRef.calibrated(ties, cal),
        *(ModelRef.calibrated(ta, c) for c in others),
        ModelRef.preview(ta, cal, others[0]),
        ModelRef.preview(ta, others[0], cal),
        ModelRef.preview(ta, cal, others[1]),
        ModelRef.preview(ta4, cal, others[1]),
    ]


@pytest.mark.parametrize("by_repr", [True, False])
def test_model_refs_are_distinct_cache_keys_for_distinct_settings(by_repr):
    """Python's hash (dict keys) and Streamlit's, the app's (HASH_FUNCS) and its default."""
    import streamlit as st

    from app.settings import HASH_FUNCS

    refs, again = _refs(), _refs()
    assert len(set(refs)) == len(refs) and again == refs and [hash(r) for r in again] == [hash(r) for r in refs]
    calls = []

    @st.cache_data(show_spinner=False, hash_funcs=HASH_FUNCS if by_repr else None)
    def table(ref):
        calls.append(ref)
        return ref.kind

    table.clear()  # the other parametrization's entries
    assert [table(r) for r in refs + again] == [r.kind for r in refs + again]
    assert calls == refs  # one cache entry per setting


def test_model_refs_reject_what_does_not_name_a_model():
    from app.settings import Merger, ModelRef

    ta, cal = Merger("task_arithmetic", (("scale", 0.3),)), _cal()
    assert cal.structure == _cal(log_lam=0.5, rho=1.0, alpha=0.9).structure != _cal(n=16).structure
    with pytest.raises(ValueError, match="needs 'cal'"):
        ModelRef("calibrated", ta)
    with pytest.raises(ValueError, match=r"takes no 'merger'.*ModelRef\.base_model"):
        ModelRef("base", ta)
    with pytest.raises(ValueError, match="kind"):
        ModelRef("expert")
    with pytest.raises(ValueError, match="structure"):
        ModelRef.preview(ta, cal, _cal(n=16))


# ----------------------------------------------------------------------------- compute and zoos (pure)


def test_cached_expert_outputs_give_diagnostics_own_tables(tiny_zoo_dir):
    """The app's fast path (experts run once per zoo) equals diagnostics' tables."""
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("ties", density=0.5, scale=0.7)
    data = zoo.calib_data(8, seed=0, split="val")
    ref = compute.scores(model, zoo, data, 20)
    fast = compute.scores(model, zoo, data, 20, compute.expert_side(zoo, data, 20))
    for key in ("output", "expert_cosine", "task_vector"):
        pd.testing.assert_frame_equal(
            fast[key].reset_index(drop=True), ref[key].reset_index(drop=True), check_dtype=False, atol=1e-6
        )


def test_cached_expert_streams_give_the_same_drift_and_respect_the_budget(tiny_zoo_dir):
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("task_arithmetic", scale=0.3)
    data = zoo.calib_data(8, seed=0, split="val")
    cache = compute.expert_streams(zoo, data)
    assert cache is not None and set(cache.calls) == set(zoo.tasks)
    pd.testing.assert_frame_equal(compute.drift(model, zoo, data, cache), compute.drift(model, zoo, data))
    assert compute.expert_streams(zoo, data, budget=cache.nbytes - 1) is None  # the estimate is exact here


def test_the_expert_trace_keeps_what_the_memory_allows():
    from app import compute

    assert 0 < compute.keep_budget() <= compute.KEEP_CAP
    assert compute.keep_budget(cap=1000) == 1000  # a machine has more than 1000 bytes available
    assert 0 < compute.expert_trace().max_bytes <= compute.KEEP_CAP
    assert compute.expert_trace(budget=123).max_bytes == 123


def test_streams_kept_while_scoring_cosines_give_the_same_drift(tiny_zoo_dir):
    """The worker's path: the cosine pass keeps the model's streams, the drift reuses them."""
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("ties", density=0.5, scale=0.7)
    data = zoo.calib_data(8, seed=0, split="val")
    side = compute.expert_side(zoo, data, 20)
    frame, own = compute.cosine_scores_and_streams(model, zoo, data, side)
    pd.testing.assert_frame_equal(frame, compute.cosine_scores(model, zoo, data, side))
    cache = compute.expert_streams(zoo, data)
    pd.testing.assert_frame_equal(compute.drift(model, zoo, data, cache, own), compute.drift(model, zoo, data))


def test_small_models_pair_work_on_one_thread_each_and_run_alone_on_every_core(tiny_zoo_dir, monkeypatch):
    from app import zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    from featcal.util import threads

    monkeypatch.delenv("FEATCAL_APP_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)
    monkeypatch.setattr(threads, "own_load", lambda *_: 0.0)  # the load is other processes' here
    assert zoos.cpu_threads(zoo, "cpu") == 1
    assert zoos.cpu_threads(zoo, "cpu", alone=True) == 6
    monkeypatch.setattr(zoos, "SMALL_MODEL", 0)  # a big model: every core either way
    assert zoos.cpu_threads(zoo, "cpu") == 6
    monkeypatch.setattr(threads, "load_average", lambda: 4.2)  # a busy machine: the free cores only
    assert zoos.cpu_threads(zoo, "cpu") == zoos.cpu_threads(zoo, "cpu", alone=True) == 2
    monkeypatch.setenv("FEATCAL_APP_THREADS", "3")  # the user's choice wins for both
    assert zoos.cpu_threads(zoo, "cpu") == zoos.cpu_threads(zoo, "cpu", alone=True) == 3


def test_the_live_note_says_how_many_test_examples_and_why_fewer_on_an_llm(tiny_zoo_dir, monkeypatch):
    from app import compute, state, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    n = min(compute.LIVE_TEST, zoos.split_size(zoo, "test"))
    assert compute.live_test(zoo) == compute.LIVE_TEST
    note = state.live_note(zoo)
    assert f"first {n} test examples per task;" in note and "language model" not in note
    monkeypatch.setattr(compute, "live_test", lambda _zoo: 3)  # as on an LLM zoo
    assert "first 3 test examples per task (fewer on a language model" in state.live_note(zoo)
    assert "first token" not in note


def test_the_live_note_of_a_language_model_zoo_says_its_accuracy_is_the_replys_first_token(monkeypatch):
    """On an encoder-decoder (or decoder) zoo the live accuracy is the reply's first token, the
    Compare page's the whole generated reply: on the FLAN-T5 stand-in 22% against 0%, so the note says which."""
    from app import state, zoos
    from featcal.zoo.score.seq2seq import Seq2SeqZoo

    monkeypatch.setattr(zoos, "split_size", lambda zoo, split: 4)
    note = state.live_note(object.__new__(Seq2SeqZoo))  # (live_note reads only the zoo's kind and test size)
    assert "first 4 test examples per task" in note
    assert "the reply's first token is the reference's" in note and "Compare page" in note
    assert "the reply's first token is the reference's" in state.accuracy_note(object.__new__(Seq2SeqZoo))
    assert "whole generated reply" in state.compare_score_note(object.__new__(Seq2SeqZoo))
    assert state.accuracy_note(object()) == "" and state.compare_score_note(object()).endswith("accuracy")


def test_a_long_exact_run_shows_its_blocks_and_the_time_left():
    """``ui.wait_with_progress`` writes the blocks done (from the run's ``on_block``) and an
    estimate of the time left while the job runs; without them, the seconds spent."""
    import threading
    from concurrent.futures import Future

    from app import ui

    class Line:
        def __init__(self):
            self.labels = []

        def update(self, label=None, state=None):
            self.labels.append(label)

    job, line, blocks = Future(), Line(), [None]
    threading.Timer(0.6, lambda: blocks.__setitem__(0, (3, 12))).start()
    threading.Timer(1.6, lambda: job.set_result("done")).start()
    ui.wait_with_progress(job, line, "Running", expected=None, after=0.1, blocks=lambda: blocks[0])
    assert any(lab.startswith("Running · ") and lab.endswith(" s") for lab in line.labels), line.labels
    with_blocks = [lab for lab in line.labels if "block 3 of 12" in lab]
    assert with_blocks and all("25%" in lab and "s left" in lab for lab in with_blocks), line.labels


def test_a_zoo_that_does_not_load_is_explained_in_wrapping_text():
    """The library's message is shown whole as text that wraps (a code block was cut off at
    1280 px), its Markdown characters escaped, with the one fix for that failure."""
    from app.zoos import explain_load_error

    msg = "spec my_zoo.yaml: experts.svhn: '/data/__models__/svhn' does not exist\nfix: download it ($5 of disk)"
    md = explain_load_error("my_zoo.yaml", FileNotFoundError(msg))
    assert "```" not in md and "Could not load zoo `my_zoo.yaml`" in md
    assert r"/data/\_\_models\_\_/svhn" in md and r"\(\$5 of disk\)" in md  # escaped, not emphasis or maths
    assert md.count("  \n") == 1 and "Fix: see the `fix:` lines above" in md
