"""Representation Surgery and SurgeryV2 as their authors define them: the module on the final
embedding, SurgeryV2's token-mean loss, the authors' schedule, and the papers' parameter counts
on a model of ViT-B/32's size (d 768, 12 blocks, a 512-d projection)."""

import copy

import pytest
import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from featcal import SurgeryOptions, surgery, surgery_v2
from featcal.baselines import registry
from featcal.baselines.trained.surgery import _loss, final_embedding, token_mean
from featcal.model.arch import resolve_blocks
from featcal.model.streams import call_model
from tiny import perturbed, tiny_bert, tiny_hf_clip, tiny_llama, tiny_open_clip_vit, zoo


def _site_outputs(model, path, batches):
    got = []
    mod = model.get_submodule(path) if path else model
    hook = mod.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        for b in batches:
            call_model(model, b)
    hook.remove()
    return torch.cat(got)


@pytest.mark.parametrize(
    "make, site, pool",
    [
        (lambda: tiny_hf_clip(with_projection=True), "visual_projection", "example"),
        (lambda: tiny_hf_clip(), "post_layernorm", "example"),
        (tiny_open_clip_vit, "", "example"),
        (tiny_llama, "model.norm", "tokens"),
        (tiny_bert, "bert.pooler", "example"),
    ],
)
def test_the_final_embedding_is_found_by_the_documented_rule(make, site, pool):
    model = make()
    emb = final_embedding(model, resolve_blocks(model)[0])
    assert (emb.path, emb.pool, emb.is_last_block) == (site, pool, False)


def test_a_mean_pooled_encoder_without_projection_reads_its_last_blocks_token_mean():
    model = tiny_bert().bert  # a bare BertModel: read by mean pooling (sentence-transformers)
    emb = final_embedding(model, resolve_blocks(model)[0])
    assert (emb.path, emb.pool, emb.is_last_block) == ("encoder.layer.1", "mean", True)
    assert final_embedding(model, "encoder.layer", embedding="pooler").path == "pooler"


def test_surgery_acts_on_the_final_embedding_only():
    base = tiny_hf_clip(with_projection=True)
    experts = {"t0": perturbed(base, 0.05, 10)}
    merged = perturbed(base, 0.02, 3)
    data = {"t0": [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]}
    cal = surgery(merged, experts, data, SurgeryOptions(steps=20, lr=1e-2, progress=False))
    assert cal.embedding == "visual_projection" and list(cal.modules["t0"]) == ["embedding"]
    model = cal.for_task("t0")
    x = data["t0"][0]
    with torch.no_grad():
        got, want = model(pixel_values=x), merged(pixel_values=x)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)  # the blocks are untouched
    assert not torch.allclose(got.image_embeds, want.image_embeds)  # the embedding is corrected
    assert cal.runs["t0"].losses[-1] < cal.runs["t0"].losses[0]


def test_surgerys_first_loss_is_the_l1_of_the_final_embeddings():
    _, experts, merged, data = zoo("hf_clip", n_tasks=1)
    cal = surgery(merged, experts, data, SurgeryOptions(steps=1, batch=12, progress=False))  # one minibatch: all 12
    site = "post_layernorm"
    l1 = torch.nn.functional.l1_loss(
        _site_outputs(merged, site, data["t0"]), _site_outputs(experts["t0"], site, data["t0"])
    )
    assert cal.runs["t0"].losses[0] == pytest.approx(float(l1), rel=1e-5)


def test_surgery_v2s_first_loss_is_the_token_mean_l1_at_every_block_plus_the_embeddings():
    _, experts, merged, data = zoo("hf_clip", n_tasks=1)
    cal = surgery_v2(merged, experts, data, SurgeryOptions(steps=1, batch=12, progress=False))
    path, blks = resolve_blocks(merged)
    want = 0.0
    for l in range(len(blks)):
        h, e = (_site_outputs(m, f"{path}.{l}", data["t0"]) for m in (merged, experts["t0"]))
        want += float(torch.nn.functional.l1_loss(h.mean(1), e.mean(1)))
    site = "post_layernorm"
    want += float(
        torch.nn.functional.l1_loss(
            _site_outputs(merged, site, data["t0"]), _site_outputs(experts["t0"], site, data["t0"])
        )
    )
    assert cal.runs["t0"].losses[0] == pytest.approx(want, rel=1e-5)


def test_the_block_loss_reads_token_means_not_tokens():
    """A per-token change that leaves each example's token mean alone costs nothing (a per-token
    loss would see it); padding is left out of the mean."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, 5, 4, generator=gen)
    wiggle = torch.randn(3, 5, 4, generator=gen)
    moved = target + (wiggle - wiggle.mean(1, keepdim=True))  # same token mean, other tokens
    clip = tiny_hf_clip()
    emb = final_embedding(clip, resolve_blocks(clip)[0])
    z = torch.randn(3, 16, generator=gen)
    out, tgt = {0: moved, "embedding": z}, {0: target, "embedding": z}
    assert float(_loss(out, tgt, emb, 2, None)) == pytest.approx(0.0, abs=1e-6)
    assert float(torch.nn.functional.l1_loss(moved, target)) > 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 3)
    padded = target.clone()
    padded[:, 3:] += 50.0
    assert torch.allclose(token_mean(padded, mask), token_mean(target, mask))


def _vit_b32_size(open_clip: bool):
    """A random model with ViT-B/32's widths (d 768, 12 blocks, 512-d projection); small MLPs and
    one patch, so that it builds in seconds (the counts depend on the widths only)."""
    torch.manual_seed(0)
    if open_clip:
        from open_clip.transformer import VisionTransformer

        return VisionTransformer(
            image_size=32, patch_size=32, width=768, layers=12, heads=12, mlp_ratio=1 / 12, output_dim=512
        ).eval()
    cfg = CLIPVisionConfig(
        image_size=32,
        patch_size=32,
        hidden_size=768,
        intermediate_size=64,
        num_hidden_layers=12,
        num_attention_heads=12,
        projection_dim=512,
    )
    return CLIPVisionModelWithProjection(cfg).eval()


@pytest.mark.parametrize("open_clip", [False, True])
def test_parameter_counts_are_the_papers_on_a_vit_b32_sized_model(open_clip):
    model = _vit_b32_size(open_clip)
    data = {"t": [torch.randn(2, 3, 32, 32)]}
    counts = {}
    for fn in (surgery, surgery_v2):
        cal = fn(model, {"t": model}, data, SurgeryOptions(steps=1, batch=2, progress=False))
        counts[cal.method] = cal.added_parameters["per_task"]["t"]["trained"]
    assert counts == {"surgery": 2 * 512 * 16, "surgery_v2": 311_296}  # 2 x 512 x 16; 2 L d r + 2 d_out r


def test_the_authors_schedule_is_the_default():
    o = SurgeryOptions()
    assert (o.rank, o.steps, o.lr, o.batch) == (16, 1000, 1e-3, 16)
    for name in ("surgery", "surgery_v2"):  # what --param and the app read
        assert {k: registry.get(name).defaults[k] for k in ("rank", "steps", "lr", "batch")} == dict(
            rank=16, steps=1000, lr=1e-3, batch=16
        )


def _per_step_reference(method, merged, expert, batches, steps, batch, lr, seed=0, rank=16):
    """The training as the papers' loops run it: each step runs expert i and the merged model (its
    modules inside) on the minibatch. featcal computes expert i's features once (and, for
    Surgery, the merged model's final embeddings): the same steps."""
    from featcal.baselines.examples import ExamplePool
    from featcal.baselines.trained import surgery as S

    model = copy.deepcopy(merged).eval().requires_grad_(False)
    path, blks = resolve_blocks(model)
    emb = S.final_embedding(model, path)
    d, d_out = S._widths(model, path, emb, batches[0])
    per_block = method == "surgery_v2"
    mods = S.surgery_modules(d, d_out, len(blks), per_block, emb, rank, torch.Generator().manual_seed(seed))
    sites = S._sites(path, len(blks), per_block, emb)
    S.place(model, path, emb, mods)
    opt = torch.optim.Adam([p for m in mods.values() for p in m.parameters()], lr=lr)
    draws = ExamplePool(batches).minibatches(batch, torch.Generator().manual_seed(seed))
    mine, theirs = S._Capture(model, sites), S._Capture(expert, sites)
    losses = []
    for _ in range(steps):
        xb = next(draws)
        with torch.no_grad():
            call_model(expert, xb)
        call_model(model, xb)
        loss = S._loss(mine.out, dict(theirs.out), emb, len(blks), S._mask(xb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return mods, losses


def _tokens(lengths, width, vocab, seed):
    """A padded token batch: ``{input_ids, attention_mask}`` with the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("method", ["surgery", "surgery_v2"])
@pytest.mark.parametrize("kind", ["bert_mean", "bert_mean_ragged", "llama_tokens", "clip_projection"])
def test_features_computed_once_train_as_the_per_step_loop_does(method, kind):
    if kind == "clip_projection":
        base = tiny_hf_clip(with_projection=True)
        batches = [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    else:
        base = tiny_llama() if kind == "llama_tokens" else tiny_bert().bert
        widths = [7, 5, 6] if kind == "bert_mean_ragged" else [7, 7, 7]  # ragged: one draw per given batch
        batches = [_tokens([w, w - 2, 3, w - 1], w, 40, i) for i, w in enumerate(widths)]
    expert, merged = perturbed(base, 0.05, 10), perturbed(base, 0.02, 3)
    fn = surgery if method == "surgery" else surgery_v2
    cal = fn(merged, {"t": expert}, {"t": batches}, SurgeryOptions(steps=9, batch=5, lr=1e-2, progress=False))
    mods, losses = _per_step_reference(method, merged, expert, batches, steps=9, batch=5, lr=1e-2)
    assert cal.runs["t"].losses == pytest.approx(losses, rel=1e-4, abs=1e-6)
    assert all(m.W_up.abs().max() > 1e-3 for m in mods.values())  # the modules moved off zero
    assert set(cal.modules["t"]) == set(mods)
    for key, mod in mods.items():
        for name, p in mod.named_parameters():
            assert torch.allclose(getattr(cal.modules["t"][key], name), p, atol=1e-5), (key, name)
