"""featcal's LoRA merge against peft's own ``merge_and_unload`` over a generated grid of
``LoraConfig`` keys (issue: every key of a PEFT config honoured exactly or refused by name).
Each config trains nothing: peft builds the adapter on a tiny Llama with attention biases, every
trainable tensor (the factors, trained biases, modules_to_save) is moved by seeded noise, the
adapter is saved, and the merged model peft makes is compared with featcal's merge of the saved
adapter onto the base as saved on disk. Outcomes:

- equal: every tensor the same to 1e-6;
- refused: featcal refused the adapter by name (a :class:`LoraError`);
- peft refuses: peft would not build the adapter (nothing for a user to bring);
- wrong: featcal merged and the models differ.

wrong must be 0. The table is printed at the end of the test run (tests/conftest.py)."""

from __future__ import annotations

import copy
import itertools
import random

import torch

from featcal.model.lora import LoraAdapter, LoraError

KEYS = {
    "r": (2, 4),
    "lora_alpha": (1, 8),
    "use_rslora": (False, True),
    "target_modules": (
        ["q_proj", "v_proj"],
        "all-linear",
        r".*\.(q_proj|o_proj)",
        ["embed_tokens", "k_proj"],
        ["gate_proj", "up_proj", "down_proj"],
    ),
    "exclude_modules": (None, ["v_proj"]),
    "bias": ("none", "all", "lora_only"),
    "modules_to_save": (None, ["lm_head"]),
    "layers_to_transform": (None, [1]),
    "rank_pattern": (None, {"layers.1.self_attn.q_proj": 6}),
    "alpha_pattern": (None, {"q_proj": 3}),
    "lora_bias": (False, True),
    "init_lora_weights": (True, "gaussian", "pissa", "olora", "orthogonal"),
    "use_dora": (False, True),
    "lora_dropout": (0.0, 0.1),
}
PLAIN = {k: v[0] for k, v in KEYS.items()}
SAMPLE = 40


def _grid() -> list[dict]:
    """The plain config with each key alone at each other value, then a seeded sample of the product."""
    docs = [dict(PLAIN)]
    for key, values in KEYS.items():
        docs += [PLAIN | {key: v} for v in values[1:]]
    product = list(itertools.product(*KEYS.values()))
    docs += [dict(zip(KEYS, row)) for row in random.Random(0).sample(product, SAMPLE)]
    return docs


def _base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_bias=True,  # so that bias "all" / "lora_only" and lora_bias have biases to train
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def _outcome(base, base_dir, out, case: dict) -> str:
    from peft import LoraConfig, get_peft_model

    kw = {k: v for k, v in case.items() if v is not None}
    model = copy.deepcopy(base)
    model.name_or_path = str(base_dir)
    try:
        pm = get_peft_model(model, LoraConfig(**kw))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # every trained tensor away from its start (B = 0 would hide the merge)
            for _, p in pm.named_parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
        pm.save_pretrained(out)
        want = {k: v.clone() for k, v in pm.merge_and_unload().state_dict().items()}
    except Exception:  # noqa: BLE001 (any refusal of peft's, building or merging, counts as one)
        return "peft refuses"
    try:
        got = LoraAdapter(out).merged(base.state_dict(), [str(base_dir)])
    except LoraError:
        return "refused"
    same = got.keys() == want.keys() and all(torch.allclose(got[k], v, rtol=0, atol=1e-6) for k, v in want.items())
    return "equal" if same else "wrong"


def test_featcal_equals_peft_or_refuses_over_the_grid(tmp_path, differential_tables):
    base = _base()
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    cases = _grid()
    outcomes, wrong = {}, []
    for i, case in enumerate(cases):
        got = _outcome(base, base_dir, tmp_path / f"a{i}", case)
        outcomes[got] = outcomes.get(got, 0) + 1
        if got == "wrong":
            wrong.append({k: v for k, v in case.items() if v != PLAIN[k]})
    differential_tables["peft vs featcal, generated LoraConfig grid"] = {"configs": len(cases), **outcomes}
    assert not wrong, f"{len(wrong)} adapters merged differently from peft (keys off the plain config): {wrong}"
    assert outcomes.get("equal", 0) >= 15 and outcomes.get("refused", 0) >= 3  # the grid exercises both
