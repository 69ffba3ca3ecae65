"""Tiny seeded random models shared by the tests (each builds in milliseconds); also imported by
benchmarks/device_check.py, so nothing here needs pytest at import time."""

from __future__ import annotations

import copy

import torch
from torch import nn

from featcal.model.arch import block_targets, get_params, resolve_blocks


class ToyBlock(nn.Module):
    """A pre-LayerNorm residual block: token mixing by a Linear over channels, then an MLP."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, h, scale=None):
        h = h + self.proj(self.ln1(h))
        out = h + self.fc2(torch.tanh(self.fc1(self.ln2(h))))
        return out if scale is None else out * scale


class ToyModel(nn.Module):
    """Stem Linear -> L ToyBlocks (called with a keyword argument) -> head on the first token."""

    def __init__(self, d_in: int = 6, d: int = 8, hidden: int = 16, n_blocks: int = 3, n_out: int = 4):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(ToyBlock(d, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(d, n_out)

    def hidden(self, x):
        h = self.stem(x)
        for blk in self.blocks:
            h = blk(h, scale=torch.tensor(1.0))
        return h

    def forward(self, x):
        return self.head(self.hidden(x)[:, 0])


def perturbed(model: nn.Module, std: float, seed: int) -> nn.Module:
    """A copy of ``model`` with every parameter moved by seeded Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(std * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return out


def toy_zoo(n_tasks: int = 3, seed: int = 0, std: float = 0.3, **kw):
    """``(base, experts, merged_by_task_arithmetic)`` of ToyModels."""
    from featcal import merge

    torch.manual_seed(seed)
    base = ToyModel(**kw)
    experts = {f"t{i}": perturbed(base, std, seed + 100 + i) for i in range(n_tasks)}
    sd = merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    merged = copy.deepcopy(base)
    merged.load_state_dict(sd)
    return base, experts, merged


def toy_data(tasks, n: int = 24, tokens: int = 5, d_in: int = 6, batch: int = 8, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return {t: list(torch.randn(n, tokens, d_in, generator=gen).split(batch)) for t in tasks}


def tiny_hf_clip(seed: int = 0, layers: int = 2, with_projection: bool = False):
    from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        image_size=16,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        projection_dim=16,
    )
    cls = CLIPVisionModelWithProjection if with_projection else CLIPVisionModel
    return cls(cfg).eval()


def tiny_open_clip_vit(seed: int = 0, layers: int = 2):
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(seed)
    return VisionTransformer(
        image_size=16, patch_size=8, width=32, layers=layers, heads=4, mlp_ratio=2.0, output_dim=16
    ).eval()


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_open_clip_clip(tmp_path, name: str, seed: int = 0):
    """A tiny random open_clip ``CLIP`` (vision and text towers) from a model config
    written to ``tmp_path / f"{name}.json"``: ``(model, config path)``."""
    import json

    from featcal.zoo.load.loaders import open_clip_model

    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    return open_clip_model(name, str(path), quick_gelu=False), path


def zoo(kind, n_tasks=2, std=0.05, n=12):
    """``(base, experts, merged, data)`` of a ``kind`` in ("toy", "hf_clip", "open_clip"):
    seeded experts around a base, Task Arithmetic (0.3) as the merge, ``n`` examples a task
    in batches of 4 (the toy zoo: its own data)."""
    if kind == "toy":
        base, experts, merged = toy_zoo(n_tasks=n_tasks, std=0.3)
        return base, experts, merged, toy_data(experts)
    make = tiny_hf_clip if kind == "hf_clip" else tiny_open_clip_vit
    base = make(0)
    experts = {f"t{i}": perturbed(base, std, 10 + i) for i in range(n_tasks)}
    from featcal import merge

    merged = copy.deepcopy(base)
    merged.load_state_dict(
        merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    )
    gen = torch.Generator().manual_seed(5)
    data = {t: list(torch.randn(n, 3, 16, 16, generator=gen).split(4)) for t in experts}
    return base, experts, merged, data


def all_target_params(model):
    """``{(block, target): (W, b)}`` (copies) of every calibrated target of ``model``."""
    _, blks = resolve_blocks(model)
    out = {}
    for i, blk in enumerate(blks):
        for t in block_targets(blk):
            W, b = get_params(blk, t)
            out[(i, t.name)] = (W.clone(), None if b is None else b.clone())
    return out


def assert_same_calibration(got, rep_got, want, rep_want, preview: bool = False):
    """Two calibrations agree: every target's weight and bias, each module's residuals and,
    with ``preview``, their previews of another setting (kept statistics)."""
    import pytest

    ref = all_target_params(want)
    for name, (W, b) in all_target_params(got).items():
        assert torch.allclose(W, ref[name][0], rtol=1e-4, atol=1e-5), name
        assert b is None or torch.allclose(b, ref[name][1], rtol=1e-4, atol=1e-5), name
    for a, b in zip(rep_got.modules, rep_want.modules):
        assert (a.name, a.rows) == (b.name, b.rows)
        assert a.residual_before == pytest.approx(b.residual_before, rel=1e-4, abs=1e-7), a.name
        assert a.residual_after == pytest.approx(b.residual_after, rel=1e-3, abs=1e-6), a.name
    if preview:
        pa, pb = rep_got.preview(lam=0.5, rho=1.5, alpha=0.7), rep_want.preview(lam=0.5, rho=1.5, alpha=0.7)
        for k, v in pa.state_dict().items():
            assert torch.allclose(v, pb.state_dict()[k], rtol=1e-4, atol=1e-5), k


# ---------------------------------------------------------------------------- text architectures


def tiny_t5(seed: int = 0, layers: int = 2):
    """A tiny random T5ForConditionalGeneration (relative position biases, gated MLP off)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=40,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg).eval()


def tiny_bert(seed: int = 0, layers: int = 2, roberta: bool = False):
    """A tiny random BertForSequenceClassification (or RobertaForSequenceClassification)."""
    from transformers import BertConfig, BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    if roberta:
        return RobertaForSequenceClassification(RobertaConfig(pad_token_id=1, **kw)).eval()
    return BertForSequenceClassification(BertConfig(**kw)).eval()


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 50, hidden: int = 32, intermediate: int = 48):
    """A tiny random LlamaForCausalLM: grouped-query attention (4 heads, 2 key/value heads), rotary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def padded_ids(n: int, length: int, vocab: int, pads: list[int], seed: int, left: bool = False, low: int = 2):
    """``(ids, mask)`` of ``n`` sequences of ``length`` token ids, sequence r padded by
    ``pads[r % len(pads)]`` tokens at its end (or start, ``left``)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    for r in range(n):
        pad = pads[r % len(pads)]
        if pad:
            if left:
                mask[r, :pad] = 0
            else:
                mask[r, length - pad :] = 0
    return ids, mask


def t5_batches(n: int = 4, batch: int = 2, enc_len: int = 7, dec_len: int = 5, seed: int = 0) -> list[dict]:
    """T5 batches, encoder and decoder of different lengths, both padded at the end."""
    ids, mask = padded_ids(n, enc_len, 40, [0, 2, 3, 1], seed)
    dec, dmask = padded_ids(n, dec_len, 40, [1, 0, 2, 0], seed + 1)
    return [
        {
            "input_ids": ids[i : i + batch],
            "attention_mask": mask[i : i + batch],
            "decoder_input_ids": dec[i : i + batch],
            "decoder_attention_mask": dmask[i : i + batch],
        }
        for i in range(0, n, batch)
    ]


def text_batches(n: int = 4, batch: int = 2, length: int = 8, vocab: int = 40, seed: int = 0, left: bool = False):
    """``{input_ids, attention_mask}`` batches, some sequences padded."""
    ids, mask = padded_ids(n, length, vocab, [0, 3, 1, 2], seed, left=left)
    return [{"input_ids": ids[i : i + batch], "attention_mask": mask[i : i + batch]} for i in range(0, n, batch)]


def text_zoo(make, data, n_tasks: int = 2, std: float = 0.02):
    """``(base, experts, merged, data)``: seeded experts around ``make(0)``, Task Arithmetic (0.3)."""
    from featcal import merge

    base = make(0)
    experts = {f"t{i}": perturbed(base, std, 10 + i) for i in range(n_tasks)}
    merged = copy.deepcopy(base)
    merged.load_state_dict(
        merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    )
    return base, experts, merged, {t: data(seed=i) for i, t in enumerate(experts)}


TEXT_WORDS = "red blue green cat dog bird sun rain snow happy sad fast slow big small".split()


def tiny_text_encoder(path, seed: int = 0, layers: int = 2, words: list[str] = TEXT_WORDS):
    """A tiny random ``BertModel`` and its word-piece tokenizer (a vocabulary of ``words``), saved
    with ``save_pretrained`` in ``path`` (the base of a text zoo spec). Returns the model."""
    from pathlib import Path

    from transformers import BertConfig, BertModel, BertTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "this", "text", "is", "about", ".", *words]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(path)
    return model


def model_expert_batches(kind: str):
    """``(model, expert, batches)`` of one architecture (``toy``, ``hf_clip``, ``open_clip``): a
    model, an expert near it, and image-like batches (the diagnostics' tests)."""
    if kind == "toy":
        base, experts, merged = toy_zoo(n_tasks=1)
        return merged, experts["t0"], toy_data(["t0"], n=6, batch=3)["t0"]
    build = {"hf_clip": tiny_hf_clip, "open_clip": tiny_open_clip_vit}[kind]
    model = build(seed=0)
    gen = torch.Generator().manual_seed(3)
    return model, perturbed(model, 0.05, 1), list(torch.randn(6, 3, 16, 16, generator=gen).split(3))


def toy_zoo_object(model_for_experts=None):
    """A two-task :class:`featcal.zoo.core.Zoo` of toy models with random calib and test splits
    (every expert ``model_for_experts`` when given)."""
    from featcal.zoo.core import TaskData, Zoo

    base, experts, _ = toy_zoo(n_tasks=2)
    if model_for_experts is not None:
        experts = {t: model_for_experts for t in experts}
    gen = torch.Generator().manual_seed(5)
    data = {
        t: TaskData(
            t,
            ["a", "b", "c"],
            {
                s: (torch.randn(12, 5, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen))
                for s in ("calib", "test")
            },
        )
        for t in experts
    }
    heads = {t: nn.Linear(8, 3).requires_grad_(False) for t in experts}
    return Zoo("toy", base, experts, heads, data, features=lambda m, x: m.hidden(x)[:, 0], fmt="torch")


def tiny_word_lm(out, words: list[str], seed: int = 0):
    """A tiny LlamaForCausalLM with a word-level tokenizer over ``words`` (after <unk> <pad> <s>
    </s>), saved together to ``out`` as a language model directory; returns ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<pad>", "<s>", "</s>", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tiny_llama(seed, 2, vocab=len(vocab), hidden=16, intermediate=32).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def module_inputs(model, module, batches) -> torch.Tensor:
    """Rows ``(tokens, d)`` of what ``module`` of ``model`` reads on ``batches`` (a plain hook)."""
    rows = []
    handle = module.register_forward_hook(lambda _m, args, _o: rows.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    return torch.cat(rows)


def any_zoo(kind: str):
    """``(base, experts, merged, data)`` of a tiny zoo of any architecture featcal calibrates: the
    vision ones of :func:`zoo` (toy, hf_clip, open_clip) or a text one (bert, t5, llama)."""
    if kind in ("toy", "hf_clip", "open_clip"):
        return zoo(kind)
    make, batches = {
        "bert": (tiny_bert, text_batches),
        "t5": (tiny_t5, t5_batches),
        "llama": (tiny_llama, text_batches),
    }[kind]
    return text_zoo(make, lambda seed: batches(seed=seed))
