"""Causal-LM zoos: chat-formatted examples, greedy replies, option log-likelihoods, scores.

An LLM zoo (:class:`LMZoo`) is a :class:`~featcal.zoo.core.Zoo` whose tasks are scored on
the model's own text instead of through frozen heads: ``featcal.evaluate(model, zoo)``
calls :meth:`LMZoo.score`, which applies the tokenizer's chat template to each example's
prompt and

- for a ``generate`` task, decodes a greedy reply of at most the task's ``max_new_tokens``
  (batched, left-padded, stopping at the end-of-turn token) and scores it;
- for a ``choice`` task, scores the log-likelihood of each option as the reply (ARC's way).

A split's inputs (what :meth:`~featcal.zoo.core.Zoo.calib_data` and the diagnostics read)
are the full chat sequences, prompt plus reference reply, right-padded; its stored labels
are the right option's index for a choice task and -1 elsewhere (:meth:`LMZoo.split` gives
the reference reply's first token instead, what the teacher-forced view predicts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from featcal.zoo.builtin.llm_tasks import Example, Task
from featcal.zoo.core import Zoo
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


def _by_length(texts: Sequence[str], tokenizer) -> list[int]:
    """Indices of ``texts`` from the shortest tokenisation to the longest (stable), so a batch
    pads little; the callers put their answers back in the original order."""
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sorted(range(len(texts)), key=lambda i: lengths[i])


@torch.no_grad()
def generate(
    model: nn.Module, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 32
) -> list[str]:
    """Greedy replies to ``prompts`` (chat template applied), special tokens dropped; batched
    by prompt length (left-padded, the key/value cache kept between steps)."""
    model.eval()
    chats = [chat_prompt(tokenizer, p) for p in prompts]
    order = _by_length(chats, tokenizer)
    out: list[str] = [""] * len(prompts)
    with left_padding(tokenizer):
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            enc = tokenizer([chats[j] for j in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(
                _device(model)
            )
            ids = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = ids[:, enc["input_ids"].shape[1] :]
            for j, row in zip(idx, new):
                out[j] = tokenizer.decode(row, skip_special_tokens=True).strip()
    return out


@torch.no_grad()
def option_logliks(model: nn.Module, tokenizer, prompt: str, options: Sequence[str]) -> list[float]:
    """The log-likelihood of each option as the assistant's reply to ``prompt`` (summed over
    the option's tokens, in float64), from one forward of prompt + option per option: the
    plain reference that :func:`choice_logliks` computes faster."""
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


def pad_rows(
    rows: Sequence[Sequence[int]], pad: int, left: bool = False, min_width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of token rows padded to the longest (at least ``min_width``), on the left
    or the right."""
    width = max(min_width, *(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols], mask[i, cols] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


@torch.no_grad()
def _batch_logliks(model: nn.Module, prompts: list[list[int]], options: list[list[list[int]]], pad: int):
    """:func:`option_logliks` of a batch of tokenised prompts, each with the same number of
    tokenised options: the prompts once (left-padded, their key/value cache kept), then every
    option after its prompt's cache in one forward (right-padded)."""
    dev, k = _device(model), len(options[0])
    ids, mask = pad_rows(prompts, pad, left=True)
    ids, mask = ids.to(dev), mask.to(dev)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].double().log_softmax(-1)  # (b, V): predicts each option's first token
    flat = [o for opts in options for o in opts]
    total = torch.stack([first[i // k, o[0]] for i, o in enumerate(flat)])
    longest = max(len(o) for o in flat)
    if longest > 1:  # the options' later tokens, each predicted from the one before it
        cache = out.cache
        cache.batch_repeat_interleave(k)
        oid, omask = pad_rows([o[:-1] or [pad] for o in flat], pad)
        omask = omask * torch.tensor([len(o) > 1 for o in flat]).unsqueeze(1)
        start = mask.sum(1).repeat_interleave(k).unsqueeze(1).cpu()
        full = torch.cat([mask.repeat_interleave(k, 0), omask.to(dev)], 1)
        pos = (start + torch.arange(oid.shape[1])).to(dev)
        logp = model(input_ids=oid.to(dev), attention_mask=full, position_ids=pos, cache=cache).logits
        logp = logp.double().log_softmax(-1)
        for i, o in enumerate(flat):
            if len(o) > 1:
                total[i] += logp[i, torch.arange(len(o) - 1), torch.tensor(o[1:])].sum()
    return total.view(len(prompts), k).cpu().tolist()


@torch.no_grad()
def choice_logliks(model: nn.Module, tokenizer, examples: Sequence[Example], batch_size: int = 32) -> list[list[float]]:
    """:func:`option_logliks` of every example, batched by prompt length: each batch's prompts
    in one forward, then all their options in a second one from the prompts' cache (the same
    numbers up to rounding, about an option count's fewer passes over the prompts)."""
    model.eval()
    chats = [chat_prompt(tokenizer, ex.prompt) for ex in examples]
    order = _by_length(chats, tokenizer)
    out: list[list[float]] = [[] for _ in examples]
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        prompts = [tokenizer(chats[j], add_special_tokens=False)["input_ids"] for j in idx]
        opts = [[tokenizer(o, add_special_tokens=False)["input_ids"] for o in examples[j].options] for j in idx]
        if len({len(o) for o in opts}) != 1:
            raise ValueError("choice examples with different numbers of options; score them apart.")
        for j, row in zip(idx, _batch_logliks(model, prompts, opts, tokenizer.pad_token_id)):
            out[j] = row
    return out


def replies(model: nn.Module, tokenizer, task: Task, examples: Sequence[Example], batch_size: int = 32) -> list:
    """The model's answers to ``examples``: reply texts (generate tasks) or option log-likelihoods."""
    if task.kind == "choice":
        return choice_logliks(model, tokenizer, examples, batch_size)
    return generate(model, tokenizer, [ex.prompt for ex in examples], task.max_new_tokens, batch_size)


def task_score(task: Task, answers: Sequence, examples: Sequence[Example]) -> float:
    """The task's metric in percent over ``examples``: the mean of its per-example score, or its
    metric over the whole set (``task.corpus``, e.g. Spearman's rho)."""
    if task.corpus is not None:
        return task.corpus(answers, examples)
    return 100.0 * sum(task.score(a, ex) for a, ex in zip(answers, examples)) / max(len(examples), 1)


# ------------------------------------------------------------------ the zoo


@dataclass
class LMZoo(Zoo):
    """A zoo of causal-LM experts scored on their replies (see the module docstring).

    ``tokenizer`` is the base's; ``examples[task][split]`` the split's :class:`Example` s
    (the same rows, in the same order, as the split's token inputs); ``task_table[task]`` how the
    task is scored (from its spec's entry, :func:`featcal.zoo.score.scorers.task`; the built-in
    zoo is a spec too)."""

    tokenizer: object = None
    examples: dict = field(default_factory=dict)
    task_table: dict = field(default_factory=dict)  # {task: Task}: how each is scored

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
            how = self.task_table[task]
            if how.kind == "none":  # merged and calibrated on, not scored (featcal has no metric for it)
                continue
            out[task] = task_score(how, self.replies(model, how, exs, batch_size), exs)
        return out

    @property
    def unscored(self) -> list[str]:
        return [t for t in self.tasks if self.task_table[t].kind == "none"]

    def task_facts(self, task: str) -> dict:
        """The task's scorer (the spec's name) and its replies' length limit (None: a choice task's
        options are scored, nothing is generated), in place of classes."""
        how = self.task_table[task]
        return {"scorer": how.scorer, "reply tokens": how.max_new_tokens or None}

    def replies(self, model: nn.Module, task: Task, examples: Sequence[Example], batch_size: int = 32) -> list:
        """The model's answers to ``examples`` (:func:`replies`; an encoder-decoder zoo answers its own way)."""
        return replies(model, self.tokenizer, task, examples, batch_size)

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
        """``(inputs, labels)``; a label is the reference reply's first token (what
        :meth:`logits` predicts; for a choice task, the right option word's first token)."""
        x, _ = super().split(task, split)
        return x, x.input_ids[torch.arange(len(x)), self.reply_start(x.input_ids)]

    @torch.no_grad()
    def logits(self, model: nn.Module, task: str, inputs) -> torch.Tensor:
        """``(n, V)``: the next-token logits where each reply begins (teacher-forced), what
        the app's accuracy, agreement and KL read instead of a head's class logits. The same
        for every task: a choice task's reference reply is the right option word, so its
        "accuracy" here is that word's first token being the most likely.

        The tokens after the last reply start are not run: a causal model's state at a position
        reads no later token, so they change nothing (up to float rounding, the products being of
        another shape)."""
        batch = as_batch(inputs)
        dev = _device(model)
        at = self.reply_start(batch["input_ids"].cpu()) - 1  # the position that predicts the reply's first token
        width = int(at.max()) + 1 if len(at) else 0
        ids, mask = batch["input_ids"][:, :width].to(dev), batch["attention_mask"][:, :width].to(dev)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        return model.get_output_embeddings()(hidden[torch.arange(len(ids), device=dev), at.to(dev)]).float()

    def generate(self, model: nn.Module, prompts: Sequence[str], max_new_tokens: int = 48) -> list[str]:
        """Greedy replies of ``model`` to free prompts (the app's generate box)."""
        return generate(model, self.tokenizer, prompts, max_new_tokens)


def _assistant_header(tokenizer) -> list[int]:
    """The token ids the chat template puts before the assistant's reply."""
    msgs = [{"role": "user", "content": "x"}]
    with_header = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    return tokenizer(with_header[len(without) :], add_special_tokens=False)["input_ids"]


def lm_mean_hidden(model: nn.Module, inputs) -> torch.Tensor:
    """``(n, d)``: a causal LM's last hidden states (after its final norm) averaged over each
    sequence's tokens, padding left out, L2-normalised (the features the diagnostics compare)."""
    batch = as_batch(inputs)
    dev = _device(model)
    ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
    return torch.nn.functional.normalize(masked_mean(hidden, mask), dim=-1)
