"""Zero-shot heads, CLIP features and the built-in class names, on tiny random CLIPs."""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from featcal.zoo.load import classnames
from featcal.zoo.load.heads import HFTextEncoder, linear_head, load_hf_text_encoder, zero_shot_weights
from featcal.zoo.load.loaders import ClipFeatures, read_state_dict

# ----------------------------------------------------------------------------- tiny builders (shared)

_CHARS = string.ascii_lowercase + string.digits + ".,!:/-'\"()&"


def write_tiny_tokenizer(folder: Path) -> int:
    """A character-level CLIP BPE vocabulary (no merges) in ``folder``; returns its size."""
    vocab = {c: i for i, c in enumerate(_CHARS)}
    vocab.update({f"{c}</w>": len(_CHARS) + i for i, c in enumerate(_CHARS)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "CLIPTokenizer", "model_max_length": 32})
    )
    return len(vocab)


def tiny_clip(folder: Path | None = None, seed: int = 0):
    """A seeded tiny HF ``CLIPModel`` (hidden 32, 2 layers, 32x32 images, patch 8), saved with
    its tokenizer to ``folder`` when given."""
    from transformers import CLIPConfig, CLIPModel

    n_vocab = len(_CHARS) * 2 + 2
    cfg = CLIPConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=n_vocab,
            max_position_embeddings=32,
            bos_token_id=n_vocab - 2,
            eos_token_id=n_vocab - 1,
            pad_token_id=n_vocab - 1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        assert write_tiny_tokenizer(folder) == n_vocab
    return model


# ----------------------------------------------------------------------------- tests


def test_zero_shot_weights_are_normalised_template_means():
    gen = torch.Generator().manual_seed(0)
    table = {}

    def encode(texts):  # a fixed random embedding per text
        return torch.stack([table.setdefault(t, torch.randn(5, generator=gen) * 3) for t in texts])

    classes, templates = ["cat", "dog", "car"], ["a {}.", "the {}!", "my {}?"]
    w = zero_shot_weights(encode, classes, templates, batch_size=4)
    assert w.shape == (3, 5)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(3))
    for k, c in enumerate(classes):
        e = torch.stack([F.normalize(table[t.format(c)], dim=0) for t in templates]).mean(0)
        torch.testing.assert_close(w[k], e / e.norm())


def test_hf_zero_shot_head_matches_direct_computation(tmp_path):
    clip = tiny_clip(tmp_path / "clip")
    encode, scale = load_hf_text_encoder(tmp_path / "clip")
    classes, templates = ["cat", "dog"], ["a photo of a {}.", "a {} photo."]
    w = zero_shot_weights(encode, classes, templates)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(2))
    assert scale == pytest.approx(float(clip.logit_scale.detach().exp()))
    tok = encode.tokenizer
    with torch.no_grad():
        for k, c in enumerate(classes):
            rows = []
            for t in templates:  # one text at a time: no padding at all
                ids = torch.tensor([tok(t.format(c))["input_ids"]])
                out = clip.text_model(input_ids=ids).pooler_output
                rows.append(F.normalize(clip.text_projection(out)[0], dim=0))
            e = torch.stack(rows).mean(0)
            torch.testing.assert_close(w[k], e / e.norm(), atol=1e-5, rtol=1e-5)


def test_hf_features_are_clip_image_embeddings(tmp_path):
    from transformers import CLIPVisionModel

    clip = tiny_clip(tmp_path / "clip")
    vision = CLIPVisionModel(clip.config.vision_config).eval()
    own = {k.removeprefix("vision_model."): k for k in vision.state_dict()}
    sd = read_state_dict(tmp_path / "clip")
    vision.load_state_dict(
        {own[k.removeprefix("vision_model.")]: v for k, v in sd.items() if k.removeprefix("vision_model.") in own}
    )
    feats = ClipFeatures("hf", "embedding", sd["visual_projection.weight"])
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = clip.visual_projection(clip.vision_model(pixel_values=x).pooler_output)
    torch.testing.assert_close(feats(vision, x), F.normalize(ref, dim=-1), atol=1e-5, rtol=1e-5)
    # The head scores cosine similarities times the logit scale.
    w = F.normalize(torch.randn(4, 16), dim=-1)
    head = linear_head(w, scale=100.0)
    assert not head.weight.requires_grad and head.bias is None
    torch.testing.assert_close(head(feats(vision, x)), 100.0 * F.normalize(ref, dim=-1) @ w.T, atol=1e-4, rtol=1e-4)


def test_hf_text_encoder_pads_without_changing_embeddings(tmp_path):
    tiny_clip(tmp_path / "clip")
    encode, _ = load_hf_text_encoder(tmp_path / "clip")
    assert isinstance(encode, HFTextEncoder)
    texts = ["a cat.", "a much longer sentence about a dog."]
    together = encode(texts)
    alone = torch.cat([encode([t]) for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_builtin_class_names_and_templates():
    sizes = {
        "sun397": 397,
        "stanford-cars": 196,
        "resisc45": 45,
        "eurosat": 10,
        "svhn": 10,
        "gtsrb": 43,
        "mnist": 10,
        "dtd": 47,
    }
    assert list(classnames.TA8) == list(sizes)
    for task, n in sizes.items():
        classes, templates = classnames.classes_and_templates(task)
        assert len(classes) == n == len(set(classes)), task
        assert templates and all(t.count("{}") == 1 for t in templates), task
    assert classnames.classes_and_templates("tanganke/stanford_cars")[0][0] == "AM General Hummer SUV 2000"
    assert len(classnames.classes_and_templates("resisc45")[1]) == 18
    with pytest.raises(KeyError, match="no built-in class names"):
        classnames.classes_and_templates("imagenet")


def test_class_names_read_from_json_are_the_ones_the_code_listed():
    """The names and templates moved from code to clip_classnames.json unchanged: the sha256 of
    ``[[task, classes, templates], ...]`` as the old module listed them."""
    listed = [[task, list(classes), list(templates)] for task, (classes, templates) in classnames.TASKS.items()]
    listed = [row for row in listed if row[0] in classnames.TA8]
    digest = hashlib.sha256(json.dumps(listed, ensure_ascii=False).encode()).hexdigest()
    assert digest == "c723b3f5322710894b31462961a96fa27173044c581a74dbe2136dcb2b58a67a"


def test_the_tall20_tasks_are_fusionbenchs_class_names_and_prompts():
    """The 12 tasks TALL14 / TALL20 add are FusionBench's own lists, read from its task modules
    (scripts/classnames_from_fusionbench.py), in its label order."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("fusion_bench")
    if spec is None:
        pytest.skip("fusion-bench is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from classnames_from_fusionbench import MODULES, read_task

    folder = Path(next(iter(spec.submodule_search_locations))) / "tasks" / "clip_classification"
    assert len(MODULES) == 20 and all(classnames.canonical_task(t) in classnames.TASKS for t in MODULES)
    for task, where in list(MODULES.items())[8:]:
        module, names = (where, "classnames") if isinstance(where, str) else where
        classes, templates = classnames.classes_and_templates(task)
        assert {"classes": classes, "templates": templates} == read_task(folder, module, names), task
    assert len(classnames.classes_and_templates("cifar100")[0]) == 100
    assert classnames.classes_and_templates("dpdl-benchmark/oxford_flowers102")[0][0] == "pink primrose"


def test_open_clip_zero_shot_rows_are_normalised_encode_text(tmp_path):
    pytest.importorskip("open_clip")
    import tiny
    from featcal.zoo.load.heads import OpenClipTextEncoder

    model, _ = tiny.tiny_open_clip_clip(tmp_path, "tiny-oc-zs")
    import open_clip

    tok = open_clip.get_tokenizer("tiny-oc-zs")
    w = zero_shot_weights(OpenClipTextEncoder(model, tok), ["cat", "dog"], ["a {}.", "the {}."])
    with torch.no_grad():
        e = F.normalize(model.encode_text(tok(["a cat.", "the cat."])), dim=-1).mean(0)
    torch.testing.assert_close(w[0], e / e.norm(), atol=1e-5, rtol=1e-5)
