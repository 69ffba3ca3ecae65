"""What names and shapes cannot tell between the base and an expert (featcal.model.compat): an expert
stored in another dtype is warned with the rounding's share of its task vector, in memory and
streamed; a tokenizer that gives ids other tokens is warned with how many, and refused when the
calibration data uses one of them."""

import json
import re
import warnings

import pytest
import torch

import tiny
from featcal import StreamOptions, calibrate, calibrate_checkpoints
from featcal.model import compat

QUIET = StreamOptions(progress=False)


def test_rounding_share_is_one_rounding_step_over_the_task_vector():
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 64, generator=g)}
    expert = {"w": base["w"] + 0.05 * torch.randn(64, 64, generator=g)}
    want = (base["w"].bfloat16().float() - base["w"]).norm() / (expert["w"] - base["w"]).norm()
    assert compat.rounding_share(base, expert, torch.bfloat16, of_base=True) == pytest.approx(float(want), rel=1e-6)
    want = (expert["w"].half().float() - expert["w"]).norm() / (expert["w"] - base["w"]).norm()
    assert compat.rounding_share(base, expert, torch.float16, of_base=False) == pytest.approx(float(want), rel=1e-6)
    assert compat.rounding_share(base, base, torch.bfloat16, of_base=True) == float("inf")


def _share_in(message: str) -> float:
    return float(re.search(r"rounding is ([\d.]+)% of the task vector", message).group(1)) / 100


def _expected_share(base, expert) -> float:
    """The share on block 0's weight matrices, computed here from the two models."""
    b = {n: p.detach() for n, p in base.named_parameters() if n.startswith("model.layers.0.") and p.dim() == 2}
    e = dict(expert.named_parameters())
    e = {n: e[n].detach().bfloat16().float() for n in b}
    step = sum((p.bfloat16().float() - p).square().sum() for p in b.values()).sqrt()
    return float(step / sum((e[n] - b[n]).square().sum() for n in b).sqrt())


def _data(n_tasks=2, high=40):
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": [{"input_ids": torch.randint(0, high, (3, 8), generator=g)}] for i in range(n_tasks)}


def test_a_bfloat16_expert_over_a_float32_base_is_warned_with_its_rounding_share_in_memory():
    base = tiny.tiny_llama(layers=2)
    experts = {f"t{i}": tiny.perturbed(base, 0.002, i + 1) for i in range(2)}  # small task vectors: ~2% rounding
    given = {"t0": {k: v.bfloat16() for k, v in experts["t0"].state_dict().items()}, "t1": experts["t1"]}
    with pytest.warns(UserWarning, match="expert 't0' is stored in bfloat16, the base in float32") as seen:
        calibrate(tiny.tiny_llama(layers=2), base=base, experts=given, calib_data=_data(), progress=False)
    notes = [str(w.message) for w in seen if "is stored in" in str(w.message)]
    assert len(notes) == 1 and "'t1'" not in notes[0]  # once, and only the bfloat16 expert
    assert _share_in(notes[0]) == pytest.approx(_expected_share(base, experts["t0"]), rel=0.01)
    assert "saved in float32" in notes[0]


@pytest.fixture
def dirs(tmp_path):
    base = tiny.tiny_llama(layers=2)
    base.save_pretrained(tmp_path / "base")
    experts = {f"t{i}": tiny.perturbed(base, 0.02, i + 1) for i in range(2)}
    for t, m in experts.items():
        m.save_pretrained(tmp_path / t)
    return tmp_path, base, experts


def test_a_bfloat16_expert_is_warned_in_the_streamed_run_too(dirs):
    root, base, experts = dirs
    experts["t1"].to(torch.bfloat16).save_pretrained(root / "t1")
    with pytest.warns(UserWarning, match="expert 't1' is stored in bfloat16") as seen:
        calibrate_checkpoints(
            root / "base", {t: root / t for t in experts}, merge="task_arithmetic", calib_data=_data(),
            out=root / "out", options=QUIET,
        )  # fmt: skip
    notes = [str(w.message) for w in seen if "is stored in" in str(w.message)]
    assert len(notes) == 1
    assert _share_in(notes[0]) == pytest.approx(_expected_share(base, experts["t1"]), rel=0.01)


def _tokenizer(path, order):
    """A word-level tokenizer.json whose token ``w{k}`` has id ``order[k]``."""
    vocab = {f"w{k}": i for k, i in enumerate(order)}
    doc = {"version": "1.0", "added_tokens": [], "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}
    (path / "tokenizer.json").write_text(json.dumps(doc))


def test_a_tokenizer_with_other_ids_is_warned_and_refused_when_the_data_uses_them(dirs):
    root, _, experts = dirs
    ids = list(range(50))
    _tokenizer(root / "base", ids)
    _tokenizer(root / "t0", ids)
    _tokenizer(root / "t1", ids[:44] + ids[44:][::-1])  # ids 44..49 reversed: 6 ids, none in the data
    run = dict(merge="task_arithmetic", options=QUIET)
    with pytest.warns(UserWarning, match=r"expert 't1''s tokenizer gives 6 token ids other tokens than the base's"):
        calibrate_checkpoints(
            root / "base", {t: root / t for t in experts}, calib_data=_data(high=40), out=root / "a", **run
        )
    _tokenizer(root / "t1", [1, 0] + ids[2:])  # w0 and w1 swapped: the data uses ids 0 and 1
    with pytest.raises(ValueError, match=r"gives 2 token ids other tokens .*id 0: 'w0' vs 'w1'.* 2 of them are in the"):
        calibrate_checkpoints(
            root / "base", {t: root / t for t in experts}, calib_data=_data(high=40), out=root / "b", **run
        )
    assert not (root / "b").exists() and not (root / ".b.featcal-partial").exists()
    with pytest.raises(ValueError, match="2 of them are in the calibration data"):  # in memory, experts as directories
        calibrate(
            experts["t0"],
            base=root / "base",
            experts={t: root / t for t in experts},
            calib_data=_data(),
            progress=False,
        )
    _tokenizer(root / "t1", ids)  # the same tokenizer: nothing said
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*tokenizer")
        calibrate_checkpoints(root / "base", {t: root / t for t in experts}, calib_data=_data(), out=root / "c", **run)


def test_vocabularies_are_read_from_every_tokenizer_file_kind(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<x>": 2}))
    assert compat.tokenizer_vocab(tmp_path) == {"a": 0, "b": 1, "<x>": 2}
    doc = {
        "model": {"type": "Unigram", "vocab": [["a", 0.0], ["b", -1.0]]},
        "added_tokens": [{"id": 2, "content": "<s>"}],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert compat.tokenizer_vocab(tmp_path) == {"a": 0, "b": 1, "<s>": 2}
    assert compat.tokenizer_vocab(tmp_path / "none") is None
    assert compat.ids_that_differ({"a": 0, "b": 1, "c": 2}, {"b": 0, "a": 1, "c": 2, "d": 3}) == {
        0: ("a", "b"),
        1: ("b", "a"),
    }


def test_token_ids_count_the_decoders_ids_too_but_not_ignored_labels():
    """An encoder-decoder's calibration batches carry decoder ids (and labels, -100 where ignored):
    a token whose id differs between tokenizers there is as used as one in ``input_ids``."""
    batch = {
        "input_ids": torch.tensor([[1, 2]]),
        "decoder_input_ids": torch.tensor([[0, 7]]),
        "labels": torch.tensor([[7, -100]]),
    }
    assert compat.token_ids({"t": [batch]}) == {0, 1, 2, 7}
    assert compat.token_ids({"t": [torch.zeros(1, 3)]}) == set()  # image batches hold no tokens
