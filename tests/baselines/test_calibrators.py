"""The trained post-merging calibrators (featcal.escal, surgery, surgery_v2) on tiny seeded models:
their defining properties, their parameter counts, and that they leave the given models alone.
Surgery's and SurgeryV2's own placement, loss and counts: tests/baselines/test_surgery.py."""

import copy

import pytest
import torch

from diagnostics import drift_table
from featcal import ESCalOptions, SurgeryOptions, TaskCalibrated, escal, merge, surgery, surgery_v2
from featcal.baselines.trained.modules import Bridge, SurgeryAdapter, escal_weights
from featcal.baselines.trained.surgery import final_embedding
from featcal.model.arch import resolve_blocks
from featcal.model.streams import call_model
from featcal.model.validate import check_same_params
from tiny import perturbed, state_snapshot, tiny_llama, zoo

TOY_PROJ = dict(qkv=("proj",), mlp_out="fc2")  # the toy block's token mixer stands in for q/k/v
METHODS = ("escal", "surgery", "surgery_v2")


def run(method, kind, merged, experts, data, **kw):
    """One calibrator, briefly trained, no progress bar."""
    kw.setdefault("seed", 0)
    kw.setdefault("batch", 4)
    if method == "escal":
        kw.setdefault("epochs", 3)
        if kind == "toy":
            kw = {**TOY_PROJ, **kw}
        return escal(merged, experts, data, ESCalOptions(progress=False, **kw))
    fn = surgery if method == "surgery" else surgery_v2
    return fn(merged, experts, data, SurgeryOptions(steps=kw.pop("steps", 10), progress=False, **kw))


def outputs(model, batches):
    with torch.no_grad():
        out = [call_model(model, b) for b in batches]
    return [getattr(o, "last_hidden_state", o) for o in out]


def zeroed(cal: TaskCalibrated) -> TaskCalibrated:
    """The calibration with every module at its initial, zero correction (A = 0, W_up = 0)."""
    with torch.no_grad():
        for mods in cal.modules.values():
            for m in mods.values():
                (m.A if isinstance(m, Bridge) else m.W_up).zero_()
    return cal


def last_outputs(model, batches) -> list[torch.Tensor]:
    """The last block's output on each batch (what every feature is read from)."""
    _, blks = resolve_blocks(model)
    got = []
    hook = blks[-1].register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    try:
        outputs(model, batches)
    finally:
        hook.remove()
    return got


def embeddings(model, batches) -> list[torch.Tensor]:
    """The final embedding (featcal.baselines.trained.surgery.final_embedding) on each batch."""
    site = final_embedding(model, resolve_blocks(model)[0]).path
    got = []
    mod = model.get_submodule(site) if site else model
    hook = mod.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    try:
        outputs(model, batches)
    finally:
        hook.remove()
    return got


def hidden_drift(model, expert, batches, method="escal") -> float:
    """Mean squared distance from the expert's of the last block's outputs (ESCal) or of the
    final embedding (Surgery, SurgeryV2: where their last module acts)."""
    read = last_outputs if method == "escal" else embeddings
    pairs = zip(read(model, batches), read(expert, batches))
    return sum(float(((g - w) ** 2).mean()) for g, w in pairs) / len(batches)


@pytest.mark.parametrize("method", METHODS)
def test_zero_initialised_modules_equal_the_merged_model_exactly(tiny_kind, method):
    _, experts, merged, data = zoo(tiny_kind)
    cal = zeroed(run(method, tiny_kind, merged, experts, data))
    for t in experts:
        model = cal.for_task(t)
        for got, want in zip(outputs(model, data[t]), outputs(merged, data[t])):
            assert torch.equal(got, want), (method, t)


def test_bridge_writes_in_the_write_span_and_reads_only_the_read_span():
    gen = torch.Generator().manual_seed(0)
    d, r = 12, 3
    U_r = torch.linalg.qr(torch.randn(d, r, generator=gen))[0]
    U_w = torch.linalg.qr(torch.randn(d, r, generator=gen))[0]
    bridge = Bridge(U_r, U_w)
    with torch.no_grad():
        bridge.A.copy_(torch.randn(r, r, generator=gen))
    h = torch.randn(5, 7, d, generator=gen)
    corr = bridge(h) - h
    assert corr.norm() > 0.1
    outside = corr - corr @ U_w @ U_w.T  # the part outside span(U_w)
    assert outside.norm() < 1e-5 * corr.norm()
    v = torch.randn(5, 7, d, generator=gen)
    v = v - v @ U_r @ U_r.T  # orthogonal to the read basis
    assert torch.allclose(bridge(h + v) - (h + v), corr, atol=1e-5)
    # a direction inside the read span does change the correction
    assert not torch.allclose(bridge(h + U_r[:, 0]) - (h + U_r[:, 0]), corr, atol=1e-3)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
def test_escal_bases_are_the_top_singular_vectors_of_the_merging_errors(kind):
    _, experts, merged, data = zoo(kind)
    cal = run("escal", kind, merged, experts, data, rank=5, last_read="own_qkv")
    _, mblks = resolve_blocks(merged)
    for t, expert in experts.items():
        _, eblks = resolve_blocks(expert)
        for l, bridge in cal.modules[t].items():
            read = min(l + 1, len(mblks) - 1)
            E_qkv = escal_weights(eblks[read])[0] - escal_weights(mblks[read])[0]  # (3d, d)
            E_out = escal_weights(eblks[l])[1] - escal_weights(mblks[l])[1]  # (d, hidden)
            for U, E in ((bridge.U_r, E_qkv), (bridge.U_w, E_out.T)):
                assert torch.allclose(U.T @ U, torch.eye(5), atol=1e-5)
                top = torch.linalg.svdvals(E.double())[:5].float()
                assert torch.allclose(torch.linalg.norm(E @ U, dim=0), top, rtol=1e-4)


def test_escal_last_block_reads_through_its_write_basis_by_default():
    _, experts, merged, data = zoo("hf_clip", n_tasks=1)
    bridges = run("escal", "hf_clip", merged, experts, data, rank=4).modules["t0"]
    assert torch.equal(bridges[1].U_r, bridges[1].U_w)
    assert not torch.allclose(bridges[0].U_r, bridges[0].U_w, atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_training_lowers_the_loss_and_moves_features_toward_the_expert(tiny_kind, method):
    _, experts, merged, data = zoo(tiny_kind)
    kw = dict(epochs=15, lr=1e-2) if method == "escal" else dict(steps=40, lr=1e-2)
    cal = run(method, tiny_kind, merged, experts, data, **kw)
    for t, expert in experts.items():
        losses = cal.runs[t].losses
        assert losses[-1] < 0.9 * losses[0], (t, losses[0], losses[-1])
        assert hidden_drift(cal.for_task(t), expert, data[t], method) < hidden_drift(merged, expert, data[t], method)


@pytest.mark.parametrize("kind", ["toy", "hf_clip"])
def test_added_parameters_follow_the_formulas(kind):
    _, experts, merged, data = zoo(kind)
    _, blks = resolve_blocks(merged)
    L, d, T = len(blks), (8 if kind == "toy" else 32), len(experts)
    for rank, r in ((4, 4), (1000, d)):  # the rank is capped by the width
        added = run("escal", kind, merged, experts, data, rank=rank, epochs=1).added_parameters
        assert added["per_task"]["t0"] == {"trained": L * r * r, "stored": L * r * r + 2 * L * d * r}
        assert added["trained"] == T * L * r * r
    n_model = sum(p.numel() for p in merged.parameters())
    # Surgery: one module on the final embedding; SurgeryV2: one per block and one more on it (the
    # toy model's embedding is its last block's output, whose module is then the final one).
    extra = 0 if kind == "toy" else 1
    for method, modules in (("surgery", 1), ("surgery_v2", L + extra)):
        added = run(method, kind, merged, experts, data, rank=3, steps=1).added_parameters
        assert added["per_task"]["t1"] == {"trained": modules * 2 * d * 3, "stored": modules * 2 * d * 3}
        assert added["stored_fraction"] == pytest.approx(modules * 2 * d * 3 / n_model)


@pytest.mark.parametrize("method", METHODS)
def test_for_task_keeps_the_blocks_and_parameter_names_and_runs_the_diagnostics(tiny_kind, method):
    _, experts, merged, data = zoo(tiny_kind)
    cal = run(method, tiny_kind, merged, experts, data)
    model = cal.for_task("t1")
    path, blks = resolve_blocks(model)
    assert path == resolve_blocks(merged)[0]
    assert all(isinstance(b, type(m)) for b, m in zip(blks, resolve_blocks(merged)[1]))
    check_same_params(merged, model, "the calibrated model")  # no added parameters, same names
    df = drift_table(model, {"t1": experts["t1"]}, {"t1": data["t1"]}, cka=False)
    drift = df[df.metric == "drift_sq_rel"].groupby("block").value.mean()
    df0 = drift_table(merged, {"t1": experts["t1"]}, {"t1": data["t1"]}, cka=False)
    drift0 = df0[df0.metric == "drift_sq_rel"].groupby("block").value.mean()
    assert len(drift) == len(blks)
    if method == "surgery" and tiny_kind != "toy":  # its one module acts after the blocks, on the embedding
        assert drift.iloc[-1] == drift0.iloc[-1]
        assert not torch.allclose(embeddings(model, data["t1"])[0], embeddings(merged, data["t1"])[0])
    else:
        assert drift.iloc[-1] != drift0.iloc[-1]  # the modules act inside the walked blocks
    assert model.state_dict().keys() >= merged.state_dict().keys()


@pytest.mark.parametrize("method", METHODS)
def test_the_given_models_and_data_are_untouched(method):
    base, experts, merged, data = zoo("open_clip")
    before = {"merged": state_snapshot(merged), **{t: state_snapshot(m) for t, m in experts.items()}}
    data_before = {t: [b.clone() for b in bs] for t, bs in data.items()}
    types = {t: type(b) for t, b in enumerate(resolve_blocks(merged)[1])}
    cal = run(method, "open_clip", merged, experts, data)
    cal.for_task("t0")
    for name, model in [("merged", merged), *experts.items()]:
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[name][k]), (name, k)
        assert all(p.requires_grad for p in model.parameters()), name
    assert {t: type(b) for t, b in enumerate(resolve_blocks(merged)[1])} == types
    assert all(torch.equal(a, b) for t in data for a, b in zip(data[t], data_before[t]))


@pytest.mark.parametrize("method", METHODS)
def test_a_seed_gives_the_same_modules(method):
    _, experts, merged, data = zoo("hf_clip")
    a, b = (run(method, "hf_clip", merged, experts, data, seed=3) for _ in range(2))
    c = run(method, "hf_clip", merged, experts, data, seed=4)
    assert a.runs["t0"].losses == b.runs["t0"].losses
    for t in experts:
        for l in a.modules[t]:
            for (name, x), y in zip(a.modules[t][l].state_dict().items(), b.modules[t][l].state_dict().values()):
                assert torch.equal(x, y), (t, l, name)
    assert a.runs["t0"].losses != c.runs["t0"].losses  # the seed draws the minibatches (and W_down)


def test_surgery_adapter_starts_as_the_identity_and_subtracts_a_relu_bottleneck():
    adapter = SurgeryAdapter(6, 2, torch.Generator().manual_seed(0))
    z = torch.randn(4, 6)
    assert torch.equal(adapter(z), z)
    with torch.no_grad():
        adapter.W_up.fill_(1.0)
    want = z - torch.relu(z @ adapter.W_down.T).sum(-1, keepdim=True).expand(-1, 6)
    assert torch.allclose(adapter(z), want, atol=1e-6)


def test_measure_overhead_times_the_model_with_and_without_the_modules():
    _, experts, merged, data = zoo("hf_clip")
    cal = run("surgery_v2", "hf_clip", merged, experts, data)
    out = cal.measure_overhead(data["t0"][0], repeats=3)
    assert out["seconds_merged"] > 0 and out["seconds_calibrated"] > 0
    assert out["overhead"] == pytest.approx(out["seconds_calibrated"] / out["seconds_merged"] - 1)
    assert cal.inference_overhead == out
    assert cal.training_seconds == pytest.approx(sum(r.seconds for r in cal.runs.values()))
    assert cal.training_seconds > 0


def _tiny_llama():
    """A tiny Llama (grouped-query attention), token ids padded at the end of some rows."""
    base = tiny_llama()
    experts = {t: perturbed(base, 0.05, i) for i, t in enumerate("ab")}
    merged = copy.deepcopy(base)
    sds = {t: m.state_dict() for t, m in experts.items()}
    merged.load_state_dict(merge("task_arithmetic", base.state_dict(), sds, scale=0.3))
    gen = torch.Generator().manual_seed(1)
    data = {}
    for t in experts:
        ids = torch.randint(0, 50, (4, 10), generator=gen)
        mask = torch.ones(4, 10, dtype=torch.long)
        mask[0, 6:] = 0
        data[t] = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in (0, 2)]
    return merged, experts, data


def test_escal_on_a_llama_with_padding():
    merged, experts, data = _tiny_llama()
    W_qkv, W_out = escal_weights(resolve_blocks(merged)[1][0])
    assert W_qkv.shape == (32 + 16 + 16, 32) and W_out.shape == (32, 48)  # q, then the shared k/v heads
    cal = escal(merged, experts, data, ESCalOptions(rank=8, epochs=10, lr=1e-2, progress=False))
    assert cal.runs["a"].losses[-1] < cal.runs["a"].losses[0]
    logits = call_model(cal.for_task("a"), data["a"][0]).logits
    assert logits.shape == (2, 10, 50) and torch.isfinite(logits).all()
    zero = zeroed(cal).for_task("a")
    assert torch.equal(call_model(zero, data["a"][0]).logits, call_model(merged, data["a"][0]).logits)


def test_bad_input_is_named():
    _, experts, merged, data = zoo("toy")
    with pytest.raises(ValueError, match="qkv=.*mlp_out"):
        escal(merged, experts, data, ESCalOptions(progress=False))
    with pytest.raises(ValueError, match="last_read"):
        ESCalOptions(last_read="nope", **TOY_PROJ)
    with pytest.raises(ValueError, match="ESCalOptions: rank, epochs and batch must be >= 1 and lr > 0"):
        ESCalOptions(epochs=0)
    with pytest.raises(ValueError, match="pool"):
        SurgeryOptions(pool="cls")
    with pytest.raises(ValueError, match="SurgeryOptions: rank, steps and batch must be >= 1 and lr > 0"):
        SurgeryOptions(lr=0.0)
    with pytest.raises(ValueError, match="embedding='nope'"):
        surgery_v2(merged, experts, data, SurgeryOptions(embedding="nope", progress=False))
    with pytest.raises(ValueError, match="tasks of experts"):
        surgery(merged, experts, {"t0": data["t0"]}, SurgeryOptions(progress=False))
    with pytest.raises(FloatingPointError, match="lower lr"):
        run("surgery_v2", "toy", merged, experts, data, steps=5, lr=1e30)
    cal = run("surgery", "toy", merged, experts, data, steps=1)
    with pytest.raises(KeyError, match="t9"):
        cal.for_task("t9")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_modules_match_the_cpus():
    _, experts, merged, data = zoo("hf_clip")
    for method in METHODS:
        cpu = run(method, "hf_clip", merged, experts, data, device="cpu")
        gpu = run(method, "hf_clip", merged, experts, data, device="cuda")
        assert next(gpu.for_task("t0").parameters()).device.type == "cuda"
        assert next(merged.parameters()).device.type == "cpu"
        assert gpu.runs["t0"].losses == pytest.approx(cpu.runs["t0"].losses, rel=1e-3, abs=1e-6)


def test_evaluate_scores_each_task_with_its_own_modules(tiny_zoo_dir):
    """featcal.evaluate reads a zoo's features through the blocks: the modules act there."""
    import featcal
    from featcal.zoo import store

    tzoo = store.read_zoo_dir(tiny_zoo_dir)
    merged = tzoo.merged("task_arithmetic", scale=0.3)
    data = tzoo.calib_data(8, batch_size=4)
    cal = surgery_v2(merged, tzoo.experts, data, SurgeryOptions(steps=2, progress=False))
    task = tzoo.tasks[0]
    x, _ = tzoo.split(task, "test")
    feats = tzoo.features(cal.for_task(task), x[:6])
    assert not torch.allclose(feats, tzoo.features(merged, x[:6]))  # trained modules change the features
    assert torch.allclose(tzoo.features(zeroed(cal).for_task(task), x[:6]), tzoo.features(merged, x[:6]))
    acc = featcal.evaluate(cal.for_task(task), tzoo, tasks=[task])
    assert list(acc) == [task] and 0.0 <= acc[task] <= 100.0


def test_the_loss_reads_only_the_chosen_and_unpadded_tokens():
    from featcal.baselines.trained.training import distance

    gen = torch.Generator().manual_seed(0)
    h, target = torch.randn(2, 4, 3, generator=gen), torch.randn(2, 4, 3, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    moved = target.clone()
    moved[0, 2:] += 100.0  # only padding differs
    assert distance(h, moved, "mse", "all", mask) == distance(h, target, "mse", "all", mask)
    assert distance(h, moved, "mse", "all", None) > distance(h, target, "mse", "all", None)
    moved = target.clone()
    moved[:, 1:] += 100.0  # only the non-first tokens differ
    assert distance(h, moved, "l1", "cls", mask) == distance(h, target, "l1", "cls", mask)
    want = (h[:, 0] - target[:, 0]).abs().mean()
    assert torch.allclose(distance(h, target, "l1", "cls", None), want)


def test_escal_epochs_count_passes_over_the_data_whatever_the_batching():
    """12 examples as one batch at batch 4: 3 minibatches a pass; padded batches that cannot be
    pooled: one step per given batch. Either way ``epochs`` passes, per task."""
    _, experts, merged, data = zoo("hf_clip", n_tasks=1)
    one = {"t0": [torch.cat(data["t0"])]}  # 12 examples, one batch
    cal = escal(merged, experts, one, ESCalOptions(rank=4, epochs=2, batch=4, progress=False))
    assert cal.runs["t0"].steps == 2 * 3 and cal.settings["steps"] == {"t0": 6}
    merged_l, experts_l, data_l = _tiny_llama()
    padded = {t: [{k: torch.cat([b[k] for b in bs]) for k in bs[0]}] for t, bs in data_l.items()}  # one padded batch
    cal = escal(merged_l, experts_l, padded, ESCalOptions(rank=4, epochs=2, batch=2, progress=False))
    assert {t: r.steps for t, r in cal.runs.items()} == {"a": 2, "b": 2}  # 2 passes, not 2 x (4 / 2) passes
