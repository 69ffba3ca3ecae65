"""FusionBench's language-model pools as generative zoo specs: Seq2SeqLMPool (FLAN-T5 on GLUE, full
and LoRA-16 experts) and CausalLMPool (MergeBench's Llama and Gemma domain experts).

A pool names models only; how each task is prompted and scored lives in FusionBench's Python code
(the GLUE prompt templates of ``fusion_bench.tasks.flan_t5_text_generation``) or in MergeBench's
harness, neither read here. featcal knows two families of tasks and writes them into the spec:

- :data:`GLUE`: FusionBench's FLAN-T5 prompts and label words, spelling included (the experts were
  fine-tuned on them), exact-match accuracy and Spearman's rho for STS-B, tested on the validation
  split (``validation_matched`` for MNLI) as its ``flan-t5_glue_text_generation`` task pool;
- :data:`MERGEBENCH`: MergeBench's five domains, each with featcal's evaluation set and scorer (the
  shipped specs assets/zoos/mergebench-*.yaml say where that is not MergeBench's own harness).

A pool whose tasks are in neither, an entry featcal does not read, a tokenizer other than the base's
family, or a key it does not know is refused by name before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

# task: (FusionBench's prompt template, label words (None: a score, written "{:.1f}"), test split)
GLUE: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "cola": (
        'Indicate if the following sentence is grammatically correct or not: "{sentence}". '
        "Answere 'acceptable' or 'unacceptable'.",
        ("unacceptable", "acceptable"),
        "validation",
    ),
    "mnli": (
        "Does the premise: '{premise}' logically imply, contradict, or is neutral to the hypothesis: "
        "'{hypothesis}'? Answere with 'entailment', 'contradiction', or 'neutral'.",
        ("entailment", "neutral", "contradiction"),
        "validation_matched",
    ),
    "mrpc": (
        "Are the following sentences '{sentence1}' and '{sentence2}' conveying the same meaning? "
        "Answere with 'yes' or 'no'.",
        ("no", "yes"),
        "validation",
    ),
    "qnli": (
        "Given the context: '{sentence}', does the question '{question}' have an answer based on the "
        "information provided? Answer with 'yes' or 'no'.",
        ("yes", "no"),
        "validation",
    ),
    "qqp": (
        "Do the questions '{question1}' and '{question2}' have the same intent? Answere with 'yes' or 'no'.",
        ("no", "yes"),
        "validation",
    ),
    "rte": (
        "Does the text: '{sentence1}' entail that '{sentence2}' is true? Provide 'yes' or 'no'.",
        ("yes", "no"),
        "validation",
    ),
    "sst2": (
        "Given the sentence '{sentence}', determine the sentiment. Is it positive or negative?",
        ("negative", "positive"),
        "validation",
    ),
    "stsb": (
        "Consider the sentences '{sentence1}' and '{sentence2}'. On a scale from 1 (completely different) "
        "to 5 (completely similar), rate the similarity.",
        None,
        "validation",
    ),
}
GLUE_MAX_NEW_TOKENS = 9  # FusionBench generates with max_length=10, the decoder's start token included


def glue_task(task: str) -> tuple[dict, dict]:
    """``(data entry, task entry)`` of a GLUE task, as FusionBench prompts and scores it."""
    prompt, labels, test = GLUE[task]
    data = {"hub": "nyu-mll/glue", "subset": task, "train_split": "train", "test_split": test}
    how: dict = {"prompt": prompt, "target": "label"}
    how |= {"labels": list(labels), "scorer": "strict_match"} if labels else {"format": "{:.1f}", "scorer": "spearman"}
    return data, how | {"max_new_tokens": GLUE_MAX_NEW_TOKENS}


SAFETY_DATA = "${FEATCAL_DATA:-~/data}/mergebench-safety"
# domain: (data entry, task entry); see assets/zoos/mergebench-*.yaml for what each stands for
MERGEBENCH: dict[str, tuple[dict, dict]] = {
    "instruction": (
        {"hub": "google/IFEval", "revision": "refs/convert/parquet", "subset": "default", "train_split": "train",
         "test_split": "train"},
        {"prompt": "{prompt}", "target": "instruction_id_list, kwargs", "scorer": "ifeval", "max_new_tokens": 1024},
    ),
    "math": (
        {"hub": "openai/gsm8k", "subset": "main"},
        {"prompt": "{question}", "target": "answer", "reference": "answer", "scorer": "final_number",
         "max_new_tokens": 512},
    ),
    "coding": (
        {"hub": "google-research-datasets/mbpp", "subset": "full"},
        {"prompt": "{text}\nYour code should pass these tests:\n{test_list}", "target": "tests=test_list",
         "reference": "code", "scorer": "code_pass_at_1", "max_new_tokens": 512},
    ),
    "multilingual": (
        {"hub": "allenai/ai2_arc", "subset": "ARC-Challenge"},
        {"prompt": "Question: {question}\nAnswer:", "target": "answerKey", "options": "choices.text",
         "labels": ["A", "B", "C", "D", "E"], "scorer": "choice"},
    ),
    "safety": (
        {"path": SAFETY_DATA, "train_split": "train", "test_split": "train"},
        {"prompt": "{prompt}", "target": "response", "scorer": "none"},
    ),
}  # fmt: skip

SEQ2SEQ_DENSE = ("AutoModelForSeq2SeqLM.from_pretrained", "T5ForConditionalGeneration.from_pretrained")
SEQ2SEQ_LORA = "load_lora_model"
CAUSAL_DENSE = ("AutoModelForCausalLM.from_pretrained", "LlamaForCausalLM.from_pretrained")
POOL_KEYS = {"_target_", "_recursive_", "_version_", "models", "tokenizer", "model_kwargs", "base_model"}
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "torch.bfloat16": "bfloat16"}


class PoolError(ValueError):
    """A language-model pool featcal cannot translate; the message names the key and the way forward."""


def _ref(src: str, task: str, entry, resolve, causal: bool) -> tuple[str, str | None]:
    """``(hub id or path, LoRA base or None)`` of one models entry."""
    entry = resolve(entry)
    if isinstance(entry, str):
        return entry, None
    if not isinstance(entry, Mapping):
        raise PoolError(f"{src}: models.{task}: expected a hub id or a mapping, got {entry!r}.")
    target = str(entry.get("_target_", ""))
    if not causal and target.endswith(SEQ2SEQ_LORA):
        return str(resolve(entry.get("peft_model_path"))), str(resolve(entry.get("base_model_path")))
    if target.endswith(CAUSAL_DENSE if causal else SEQ2SEQ_DENSE):
        return str(resolve(entry.get("pretrained_model_name_or_path"))), None
    raise PoolError(
        f"{src}: models.{task}: {target or 'this entry'} is not a model featcal reads here (a dense model by hub id"
        + ("" if causal else f", or a LoRA adapter via {SEQ2SEQ_LORA}")
        + ")."
    )


def _dtype(src: str, kwargs) -> str | None:
    if not kwargs:
        return None
    unknown = [k for k in kwargs if k not in ("torch_dtype", "dtype")]
    if unknown:
        raise PoolError(f"{src}: model_kwargs {unknown}: featcal reads only torch_dtype; remove them or load by hand.")
    value = str(next(iter(kwargs.values())))
    if value not in DTYPES:
        raise PoolError(f"{src}: model_kwargs.torch_dtype {value!r}: one of {sorted(DTYPES)}.")
    return DTYPES[value]


def lm_spec(src: str, pool: Mapping, taskpool: Mapping, resolve, entry_of, causal: bool) -> dict:
    """The generative spec of a CausalLMPool (``causal``) or Seq2SeqLMPool, ``resolve`` reading the
    pool's own ``${...}`` references and ``entry_of`` making a model entry of a hub id or path."""
    unknown = sorted(k for k in pool if k not in POOL_KEYS and k != "test_datasets" and not k.startswith("_"))
    if unknown:
        raise PoolError(f"{src}: key(s) {unknown}: featcal does not read them for a language-model pool.")
    models = pool.get("models") or {}
    if not isinstance(models, Mapping):
        raise PoolError(f"{src}: models: {models!r} is not a mapping of name -> model (a template to fill?).")
    models = dict(models)
    if "_pretrained_" not in models:
        raise PoolError(f"{src}: models: no _pretrained_ (the base model).")
    base, _ = _ref(src, "_pretrained_", models.pop("_pretrained_"), resolve, causal)
    if not models:
        raise PoolError(f"{src}: models: only _pretrained_; a zoo needs experts.")
    tokenizer = resolve(pool.get("tokenizer"))
    tokenizer = resolve(tokenizer.get("pretrained_model_name_or_path")) if isinstance(tokenizer, Mapping) else tokenizer
    if tokenizer and tokenizer != base and not (not causal and "flan-t5" in str(tokenizer) and "flan-t5" in base):
        raise PoolError(f"{src}: tokenizer {tokenizer!r} is not the base's ({base!r}); featcal reads the base's.")
    table = MERGEBENCH if causal else GLUE
    experts, data, tasks = {}, {}, {}
    for name, entry in models.items():
        task = name.removeprefix("glue-")
        if task not in table:
            known = "MergeBench's domains" if causal else "the GLUE tasks"
            raise PoolError(
                f"{src}: models.{name}: featcal has no evaluation data or scorer for it (it knows {known}: "
                f"{sorted(table)}); write the spec's data and tasks yourself (docs/zoos.md, generative zoos)."
            )
        ref, lora_base = _ref(src, name, entry, resolve, causal)
        if lora_base and lora_base != base:
            raise PoolError(f"{src}: models.{name}: LoRA on {lora_base!r}, the pool's base is {base!r}.")
        experts[task] = entry_of(ref)
        data[task], tasks[task] = MERGEBENCH[task] if causal else glue_task(task)
    if not causal:
        _check_glue_tests(src, taskpool, pool.get("test_datasets") or {}, resolve)
    spec = {
        "name": Path(src).stem,
        "modality": "causal_lm" if causal else "seq2seq",
        "base": entry_of(base),
        "experts": experts,
        "data": {t: dict(d) for t, d in data.items()},
        "tasks": {t: dict(h) for t, h in tasks.items()},
        "splits": {"calib": 256, "val": 32, "test": None, "seed": 42},
    }
    dtype = _dtype(src, pool.get("model_kwargs"))
    return spec | ({"dtype": dtype} if dtype else {})


def _check_glue_tests(src: str, tp: Mapping, tests: Mapping, resolve) -> None:
    """The test sets a GLUE pool or its task pool names must be featcal's (FusionBench's FLAN-T5 GLUE
    task pool's): the same GLUE task, the same split."""
    named = [(t.get("name"), (t.get("dataset") or {}).get("split"), "task pool") for t in tp.get("tasks") or []]
    named += [(resolve(e.get("name")), resolve(e.get("split")), f"test_datasets.{k}") for k, e in tests.items()]
    if tp and "FlanT5GLUETextGeneration" not in str(tp.get("type") or tp.get("_target_") or ""):
        raise PoolError(
            f"{src}: task pool type {tp.get('type')!r}: with a GLUE pool featcal reads FusionBench's "
            "FlanT5GLUETextGenerationTaskPool (flan-t5_glue_text_generation.yaml)."
        )
    for name, split, where in named:
        if name not in GLUE or split != GLUE[name][2]:
            raise PoolError(
                f"{src}: {where}: {name!r} on split {split!r}; featcal tests the GLUE tasks on "
                f"{ {t: v[2] for t, v in GLUE.items()} }."
            )
