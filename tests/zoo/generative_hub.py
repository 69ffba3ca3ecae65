"""Stand-ins of the paper's generative settings, saved where a real user's would be.

Tiny seeded models under the real hub ids in a Hugging Face cache of the test's own (``models--google--
flan-t5-base/snapshots/<commit>/``, ``models--MergeBench--Llama-3.2-3B-Instruct_math/...``), with word-
level tokenizers, and tiny data sets as the hub caches them (parquet files under ``datasets--nyu-mll--
glue/snapshots/<commit>/cola/validation-00000-of-00001.parquet``): every path a real user takes, offline,
without weights. The models are random, so their scores mean nothing; what is tested is that the
files are found, read, merged, calibrated and scored as the real ones would be.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

WORDS = (
    "the a is of to and not yes no it this that sentence sentiment positive negative acceptable unacceptable "
    "entailment neutral contradiction question answer same meaning rate similarity good bad cat dog sat mat "
    "what how many has gets more now total def return x y print if else for in range red blue green which "
    "color sky grass write words capital letters user assistant : ' , . ? ( ) = + 1 2 3 4 5 6 7 8 9 0"
).split()
CHAT = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def offline_cache(tmp_path: Path, monkeypatch) -> Path:
    """An HF cache of the test's own (``$HF_HOME``), offline, and ``$FEATCAL_DATA`` beside it; its hub folder."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEATCAL_DATA", str(tmp_path / "data"))
    return tmp_path / "hf" / "hub"


def snapshot(hub: Path, repo_id: str, kind: str = "model", revision: str = "main") -> Path:
    """The snapshot folder of ``repo_id`` in the HF cache at ``hub`` (``refs/<revision>`` pointing at it)."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    folder = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    (folder / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def word_tokenizer(chat: bool):
    """A fast word-level tokenizer over :data:`WORDS` (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``<s>`` 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "</s>", "<unk>", "<s>", *dict.fromkeys(WORDS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    if chat:
        fast.chat_template = CHAT
    return fast


def _perturbed(model, seed: int, std: float = 0.02):
    """A copy of ``model`` with seeded noise on every weight: an 'expert' fine-tuned from it."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
    return out


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


# ----------------------------------------------------------------------------- FLAN-T5 on GLUE


def t5_standin(hub: Path, base_id: str = "google/flan-t5-base", expert_ids: dict | None = None, lora: bool = False):
    """A tiny T5 under ``base_id`` and one expert per task under ``expert_ids`` (dense, or PEFT
    LoRA-16-style adapters when ``lora``), with the word tokenizer."""
    from transformers import T5Config, T5ForConditionalGeneration

    tok = word_tokenizer(chat=False)
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    base = T5ForConditionalGeneration(cfg).eval()
    snap = snapshot(hub, base_id)
    base.save_pretrained(snap)
    tok.save_pretrained(snap)
    for i, (task, repo) in enumerate((expert_ids or {}).items()):
        out = snapshot(hub, repo)
        if lora:
            _lora_expert(base, out, base_id, seed=10 + i, targets=["q", "v"])
        else:
            _perturbed(base, 10 + i).save_pretrained(out)
            tok.save_pretrained(out)
    return base


def _lora_expert(base, out: Path, base_id: str, seed: int, targets: list[str]) -> None:
    """A PEFT LoRA adapter (rank 16) on ``base`` with seeded non-zero B, saved by peft itself."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), cfg)
    model.peft_config["default"].base_model_name_or_path = base_id
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    model.save_pretrained(out)


GLUE_ROWS = {
    "cola": lambda i: {"sentence": f"the cat sat {i}", "label": i % 2, "idx": i},
    "mnli": lambda i: {"premise": f"the cat sat {i}", "hypothesis": "a dog sat", "label": i % 3, "idx": i},
    "mrpc": lambda i: {"sentence1": "the cat", "sentence2": f"the dog {i}", "label": i % 2, "idx": i},
    "qnli": lambda i: {"question": f"what is the cat {i}", "sentence": "the cat sat", "label": i % 2, "idx": i},
    "qqp": lambda i: {"question1": f"how many cat {i}", "question2": "how many dog", "label": i % 2, "idx": i},
    "rte": lambda i: {"sentence1": f"the cat sat {i}", "sentence2": "the dog sat", "label": i % 2, "idx": i},
    "sst2": lambda i: {"sentence": f"a good dog {i}", "label": (i + 1) % 2, "idx": i},
    "stsb": lambda i: {"sentence1": "the cat", "sentence2": f"a dog {i}", "label": float(i % 5) + 0.25, "idx": i},
}


def glue_standin(hub: Path, n: int = 24) -> None:
    """Tiny GLUE tasks as ``nyu-mll/glue`` is cached: ``<task>/<split>-00000-of-00001.parquet``."""
    snap = snapshot(hub, "nyu-mll/glue", "dataset")
    for task, rows in GLUE_ROWS.items():
        for split in ("train", "validation_matched" if task == "mnli" else "validation"):
            write_parquet(snap / task / f"{split}-00000-of-00001.parquet", [rows(i) for i in range(n)])


# ----------------------------------------------------------------------------- MergeBench Llamas

MERGEBENCH_MODELS = ("Llama-3.2-3B-Instruct", "Llama-3.1-8B-Instruct")
MERGEBENCH_DATA = {  # repo: (revision, {split: file}) as the hub caches them
    "openai/gsm8k": (
        "main",
        {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"},
    ),
    "google/IFEval": ("refs/convert/parquet", {"train": "default/train/0000.parquet"}),
    "google-research-datasets/mbpp": (
        "main",
        {"train": "full/train-00000-of-00001.parquet", "test": "full/test-00000-of-00001.parquet"},
    ),
    "allenai/ai2_arc": (
        "main",
        {"train": "ARC-Challenge/train-00000-of-00001.parquet", "test": "ARC-Challenge/test-00000-of-00001.parquet"},
    ),
}


def _gsm8k(i: int) -> dict:
    return {"question": f"the cat has {i} what is 1 + {i % 3}", "answer": f"1 + {i % 3} #### {1 + i % 3}"}


def _ifeval(i: int) -> dict:
    return {
        "key": i,
        "prompt": f"write words in capital letters {i}",
        "instruction_id_list": ["change_case:english_capital"],
        "kwargs": [{"num_words": None, "relation": None}],  # IFEval fills every kwarg, null where unused
    }


def _mbpp(i: int) -> dict:
    return {
        "task_id": i,
        "text": f"write a function f{i} of x that returns x + 1",
        "code": f"def f{i}(x):\n    return x + 1",
        "test_list": [f"assert f{i}(1) == 2", f"assert f{i}(2) == 3"],
        "test_setup_code": "",
        "challenge_test_list": [],
    }


def _arc(i: int) -> dict:
    return {
        "id": str(i),
        "question": f"which color is the sky {i}",
        "choices": {"text": ["red", "blue", "green"], "label": ["A", "B", "C"]},
        "answerKey": "B",
    }


ROWS = {
    "openai/gsm8k": _gsm8k,
    "google/IFEval": _ifeval,
    "google-research-datasets/mbpp": _mbpp,
    "allenai/ai2_arc": _arc,
}


def mergebench_data(hub: Path, local: Path, n: int = 24) -> None:
    """Tiny stand-ins of the data sets the shipped MergeBench specs name, in the hub's parquet layout,
    and the safety domain's local parquet file under ``local`` (``$FEATCAL_DATA``)."""
    for repo, (revision, files) in MERGEBENCH_DATA.items():
        snap = snapshot(hub, repo, "dataset", revision)
        for name in files.values():
            write_parquet(snap / name, [ROWS[repo](i) for i in range(n)])
    rows = [{"prompt": f"how to make a bad thing {i}", "response": "no"} for i in range(n)]
    write_parquet(local / "mergebench-safety" / "train-00000-of-00001.parquet", rows)


def llama_standin(hub: Path, base_id: str, expert_ids: dict[str, str]):
    """A tiny Llama (with the word tokenizer and a chat template) under ``base_id`` and dense experts
    under ``expert_ids`` (MergeBench's experts are full fine-tunes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer(chat=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=3, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    base = LlamaForCausalLM(cfg).eval()
    snap = snapshot(hub, base_id)
    base.save_pretrained(snap)
    tok.save_pretrained(snap)
    for i, repo in enumerate(expert_ids.values()):
        out = snapshot(hub, repo)
        _perturbed(base, 20 + i).save_pretrained(out)
        tok.save_pretrained(out)
    return base
