"""Causal-LM zoos: chat-formatted examples, greedy replies, option log-likelihoods, scores.

An LLM zoo (:class:`LMZoo`) is a :class:`~featcal.zoo.core.Zoo` whose tasks are scored on
the model's own text instead of through frozen heads: ``featcal.evaluate(model, zoo)``
calls :meth:`LMZoo.score`, which applies the tokenizer's chat template to each example's
prompt and

- for a ``generate`` task, decodes a greedy reply of at most the task's ``max_new_tokens``
  (batched, left-padded, stopping at the end-of-turn token) and scores it;
- for a ``choice`` task, scores the log-likelihood of each option as the reply (ARC's way).

A split's inputs (what :meth:`~featcal.zoo.core.Zoo.calib_data` and the diagnostics read)
are the full chat sequences, prompt plus reference reply, right-padded; its labels are
the right option for a choice task and -1 elsewhere.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from featcal.zoo.core import Zoo
from featcal.zoo.llm_tasks import TASKS, Example
from featcal.zoo.tokens import TokenRows, as_batch, masked_mean

# ------------------------------------------------------------------ chat formatting


def chat_prompt(tokenizer, prompt: str) -> str:
    """The user's ``prompt`` in the tokenizer's chat template, up to the assistant's turn."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def encode_chats(tokenizer, examples: Sequence[Example], max_len: int) -> tuple[TokenRows, torch.Tensor]:
    """``(TokenRows, reply_mask)``: prompt + reference reply + end-of-turn of each example,
    right-padded to the longest (at most ``max_len`` tokens, cut on the left of the prompt
    if longer); ``reply_mask`` (n, L) marks the reply's tokens (the fine-tuning loss's)."""
    rows, replies = [], []
    for ex in examples:
        p = tokenizer(chat_prompt(tokenizer, ex.prompt), add_special_tokens=False)["input_ids"]
        r = tokenizer(ex.answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        keep = max(0, len(p) + len(r) - max_len)
        rows.append((p[keep:] + r)[:max_len])
        replies.append(min(len(r), max_len))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    reply = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, k) in enumerate(zip(rows, replies)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        reply[i, len(row) - k : len(row)] = True
    return TokenRows(ids, mask), reply


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (so left padding does not shift them)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


@contextlib.contextmanager
def left_padding(tokenizer):
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = side


# ------------------------------------------------------------------ replies and log-likelihoods


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def generate(
    model: nn.Module, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 32
) -> list[str]:
    """Greedy replies to ``prompts`` (chat template applied), special tokens dropped."""
    model.eval()
    out: list[str] = []
    with left_padding(tokenizer):
        for i in range(0, len(prompts), batch_size):
            chats = [chat_prompt(tokenizer, p) for p in prompts[i : i + batch_size]]
            enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(_device(model))
            ids = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = ids[:, enc["input_ids"].shape[1] :]
            out += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]
    return out


@torch.no_grad()
def option_logliks(model: nn.Module, tokenizer, prompt: str, options: Sequence[str]) -> list[float]:
    """The log-likelihood of each option as the assistant's reply to ``prompt`` (summed over
    the option's tokens, in float64), from one batched forward."""
    model.eval()
    p = tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    opts = [tokenizer(o, add_special_tokens=False)["input_ids"] for o in options]
    width = len(p) + max(len(o) for o in opts)
    ids = torch.full((len(opts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, o in enumerate(opts):
        ids[k, : len(p) + len(o)] = torch.tensor(p + o)
        mask[k, : len(p) + len(o)] = 1
    dev = _device(model)
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.double().log_softmax(-1).cpu()
    out = []
    for k, o in enumerate(opts):
        steps = torch.arange(len(p) - 1, len(p) - 1 + len(o))  # the positions that predict the option's tokens
        out.append(float(logits[k, steps, torch.tensor(o)].sum()))
    return out


@torch.no_grad()
def choice_logliks(model: nn.Module, tokenizer, examples: Sequence[Example], batch_size: int = 32) -> list[list[float]]:
    """:func:`option_logliks` of every example; when each option is one token (the letters
    A-D), from one forward of the prompts alone, batched: the next-token log-probabilities
    after each prompt are the options' log-likelihoods (the same numbers, a quarter of the work)."""
    single = all(len(tokenizer(o, add_special_tokens=False)["input_ids"]) == 1 for ex in examples for o in ex.options)
    if not single:
        return [option_logliks(model, tokenizer, ex.prompt, ex.options) for ex in examples]
    model.eval()
    out: list[list[float]] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        enc = tokenizer(
            [chat_prompt(tokenizer, ex.prompt) for ex in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
        dev = _device(model)
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()  # right-padded
        last = logits[torch.arange(len(chunk)), mask.sum(1) - 1].double().log_softmax(-1)  # (b, V)
        for k, ex in enumerate(chunk):
            toks = [tokenizer(o, add_special_tokens=False)["input_ids"][0] for o in ex.options]
            out.append([float(last[k, t]) for t in toks])
    return out


def replies(model: nn.Module, tokenizer, task: str, examples: Sequence[Example], batch_size: int = 32) -> list:
    """The model's answers to ``examples``: reply texts (generate tasks) or option log-likelihoods."""
    spec = TASKS[task]
    if spec.kind == "choice":
        return choice_logliks(model, tokenizer, examples, batch_size)
    return generate(model, tokenizer, [ex.prompt for ex in examples], spec.max_new_tokens, batch_size)


def task_score(task: str, answers: Sequence, examples: Sequence[Example]) -> float:
    """The task's metric in percent over ``examples``."""
    score = TASKS[task].score
    return 100.0 * sum(score(a, ex) for a, ex in zip(answers, examples)) / max(len(examples), 1)


# ------------------------------------------------------------------ the zoo


@dataclass
class LMZoo(Zoo):
    """A zoo of causal-LM experts scored on their replies (see the module docstring).

    ``tokenizer`` is the base's; ``examples[task][split]`` the split's :class:`Example` s
    (the same rows, in the same order, as the split's token inputs)."""

    tokenizer: object = None
    examples: dict = field(default_factory=dict)

    def score(
        self,
        model: nn.Module,
        split: str = "test",
        batch_size: int = 32,
        tasks: Mapping[str, object] | list[str] | None = None,
        max_per_task: int | None = None,
    ) -> dict[str, float]:
        out, batch_size = {}, min(batch_size, 32)  # replies: 32 prompts a batch at most
        for task in list(tasks) if tasks is not None else self.tasks:
            exs = self.examples[task][split][:max_per_task]
            out[task] = task_score(task, replies(model, self.tokenizer, task, exs, batch_size), exs)
        return out

    # The app's and the diagnostics' fast view: one teacher-forced step per example.

    def reply_start(self, ids: torch.Tensor) -> torch.Tensor:
        """``(n,)``: where each chat sequence's reply begins (just after the last assistant header)."""
        header = _assistant_header(self.tokenizer)
        out = []
        for row in ids.tolist():
            hits = [i for i in range(len(row) - len(header) + 1) if row[i : i + len(header)] == header]
            if not hits:
                raise ValueError("a sequence without the chat template's assistant header; is it from this zoo?")
            out.append(hits[-1] + len(header))
        return torch.tensor(out)

    def split(self, task: str, split: str):
        """``(inputs, labels)``; a free-text task's label is its reference reply's first token
        (what :meth:`logits` predicts), a choice task's the right option."""
        x, y = super().split(task, split)
        if TASKS[task].kind != "choice":
            y = x.input_ids[torch.arange(len(x)), self.reply_start(x.input_ids)]
        return x, y

    @torch.no_grad()
    def logits(self, model: nn.Module, task: str, inputs) -> torch.Tensor:
        """``(n, V)``: the next-token logits where each reply begins (teacher-forced; for a
        choice task ``(n, options)``: the option tokens' only), what the app's accuracy,
        agreement and KL read instead of a head's class logits."""
        batch = as_batch(inputs)
        dev = _device(model)
        ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        at = self.reply_start(ids.cpu()).to(dev) - 1  # the position that predicts the reply's first token
        z = model.get_output_embeddings()(hidden[torch.arange(len(ids), device=dev), at]).float()
        if TASKS[task].kind == "choice":
            first = self.examples[task]["test"][0].options
            z = z[:, [self.tokenizer(o, add_special_tokens=False)["input_ids"][0] for o in first]]
        return z

    def generate(self, model: nn.Module, prompts: Sequence[str], max_new_tokens: int = 48) -> list[str]:
        """Greedy replies of ``model`` to free prompts (the app's generate box)."""
        return generate(model, self.tokenizer, prompts, max_new_tokens)


def _assistant_header(tokenizer) -> list[int]:
    """The token ids the chat template puts before the assistant's reply."""
    msgs = [{"role": "user", "content": "x"}]
    with_header = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    return tokenizer(with_header[len(without) :], add_special_tokens=False)["input_ids"]


EXAMPLES = "examples.json"  # in an LLM zoo's directory: {task: {split: [Example as a dict]}}


def examples_json(examples: Mapping[str, Mapping[str, Sequence[Example]]]) -> str:
    doc = {t: {s: [ex.to_dict() for ex in exs] for s, exs in splits.items()} for t, splits in examples.items()}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def read_examples(path) -> dict[str, dict[str, list[Example]]]:
    doc = json.loads(Path(path).read_text())
    return {t: {s: [Example.from_dict(d) for d in exs] for s, exs in splits.items()} for t, splits in doc.items()}


def lm_mean_hidden(model: nn.Module, inputs) -> torch.Tensor:
    """``(n, d)``: a causal LM's last hidden states (after its final norm) averaged over each
    sequence's tokens, padding left out, L2-normalised (the features the diagnostics compare)."""
    batch = as_batch(inputs)
    dev = _device(model)
    ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
    return torch.nn.functional.normalize(masked_mean(hidden, mask), dim=-1)
