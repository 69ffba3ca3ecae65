"""Bad input to calibrate: a clear error naming the problem, and nothing changed."""

import copy

import pytest
import torch

import tiny
from featcal import FeatCalConfig, calibrate


@pytest.fixture
def zoo():
    base, experts, merged = tiny.toy_zoo()
    return base, experts, merged, tiny.toy_data(experts)


def _run(zoo, **over):
    base, experts, merged, data = zoo
    kw = dict(base=base, experts=experts, calib_data=data, config=FeatCalConfig(), progress=False)
    kw.update(over)
    return calibrate(over.pop("merged", merged), **{k: v for k, v in kw.items() if k != "merged"})


def test_mismatched_shapes_name_the_first_parameter(zoo):
    base, experts, merged, data = zoo
    bad = tiny.ToyModel(hidden=12)
    with pytest.raises(ValueError, match=r"expert 't1': parameter 'blocks.0.fc1.weight' has shape"):
        _run(zoo, experts={**experts, "t1": bad})


def test_mismatched_names(zoo):
    base, experts, merged, data = zoo
    with pytest.raises(ValueError, match="base has no parameter 'blocks.2"):
        _run(zoo, base=tiny.ToyModel(n_blocks=2))


def test_task_names_must_match(zoo):
    base, experts, merged, data = zoo
    with pytest.raises(ValueError, match=r"only in experts \['t2'\], only in calib_data \['x'\]"):
        _run(zoo, calib_data={"t0": data["t0"], "t1": data["t1"], "x": data["t2"]})


def test_empty_task(zoo):
    base, experts, merged, data = zoo
    with pytest.raises(ValueError, match="task 't1' has no examples in calib_data"):
        _run(zoo, calib_data={**data, "t1": []})


def test_nan_weights_name_block_and_module(zoo):
    base, experts, merged, data = zoo
    bad = copy.deepcopy(experts["t2"])
    with torch.no_grad():
        bad.blocks[1].fc2.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"expert 't2'.*block 1, module fc2"):
        _run(zoo, experts={**experts, "t2": bad})


def test_nan_features_name_block_and_module(zoo):
    base, experts, merged, data = zoo
    bad = {**data, "t0": [torch.full_like(data["t0"][0], float("inf"))]}
    with pytest.raises(FloatingPointError, match=r"block 0, module 'ln1'"):
        _run(zoo, calib_data=bad)


def test_non_floating_model(zoo):
    base, experts, merged, data = zoo
    m = copy.deepcopy(merged)
    m.register_parameter("q", torch.nn.Parameter(torch.zeros(2, dtype=torch.int8), requires_grad=False))
    with pytest.raises(TypeError, match="'q' is not floating point"):
        _run(zoo, merged=m)


def test_unknown_architecture_asks_for_blocks():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])

        def forward(self, x):
            for m in self.stack:
                x = m(x)
            return x

    odd = Odd()
    data = {"a": [torch.randn(4, 3)]}
    with pytest.raises(ValueError, match="blocks='dotted.path'.*'stack'"):
        calibrate(odd, base=odd, experts={"a": odd}, calib_data=data, progress=False)
    out, report = calibrate(odd, base=odd, experts={"a": odd}, calib_data=data, blocks="stack", progress=False)
    assert [(m.block, m.name) for m in report.modules] == [(0, ""), (1, "")]  # each block is a Linear


def test_few_rows_is_noted_once_not_warned(zoo):
    """Fewer token rows than a module is wide asks nothing of the user (the ridge lam + eps keeps the
    solve defined): one note in ``report.notes``, no warning."""
    import warnings

    base, experts, merged, data = zoo
    tiny_data = {t: [b[:1, :2]] for t, b in ((t, bs[0]) for t, bs in data.items())}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _, report = _run(zoo, calib_data=tiny_data)
    assert not [w for w in rec if "fewer than" in str(w.message)]
    assert [n for n in report.notes if "fewer than its input width" in n] == report.notes and len(report.notes) == 1
    assert not [w for w in report.warnings if "fewer than" in w]
    assert report.summary().endswith("(1 note: report.notes)")  # where a library user reads them
    assert report.summary(notes_at="below").endswith("(1 note: below)")  # where the app shows them


def test_failed_run_leaves_inputs_untouched(zoo):
    base, experts, merged, data = zoo
    snap = tiny.state_snapshot(merged)
    bad = {**data, "t0": [torch.full_like(data["t0"][0], float("nan"))]}
    with pytest.raises(FloatingPointError):
        _run(zoo, calib_data=bad)
    assert all(torch.equal(v, snap[k]) for k, v in merged.state_dict().items())


def test_config_rejects_invalid_values():
    with pytest.raises(ValueError, match="lam"):
        FeatCalConfig(lam=-1)
    with pytest.raises(ValueError, match="eps"):
        FeatCalConfig(eps=0)
    with pytest.raises(ValueError, match="stats_dtype"):
        FeatCalConfig(stats_dtype=torch.float16)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        FeatCalConfig(linear=False, layernorm=False)


@pytest.mark.parametrize("value, bad", [(float("nan"), True), (float("-inf"), True), (3e38, False)])
def test_large_parameters_are_checked_exactly(value, bad):
    """Large parameters are checked through their sum; a sum that overflows on finite
    values (3e38 + 3e38) is not mistaken for NaN/Inf."""
    from featcal.model import validate

    p = torch.zeros(validate.SMALL * 2)
    p[7] = p[-1] = value
    params = {"blocks.3.mlp.fc1.weight": p}
    if bad:
        with pytest.raises(FloatingPointError, match=r"expert 't0'.*block 3, module mlp.fc1"):
            validate._finite_params(params, "expert 't0'", "blocks")
    else:
        validate._finite_params(params, "expert 't0'", "blocks")
