"""Encoder-decoder zoos (FLAN-T5 on GLUE as text): the prompt to the encoder, the reply from the decoder.

:class:`Seq2SeqZoo` is an :class:`~featcal.zoo.score.lm.LMZoo` whose model is an encoder-decoder: no chat
template, the prompt is the encoder's input as it stands, a reply is the decoder's greedy output
(:func:`generate`), and a split's inputs are :class:`Seq2SeqRows`: the prompt's tokens and the reference
reply's, which :func:`featcal.calibrate` reads as ``{input_ids, attention_mask, decoder_input_ids,
decoder_attention_mask}`` (the decoder's input is the reply shifted right behind the decoder's start
token, as T5 is trained), so both stacks see the experts' own teacher-forced streams.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from featcal.zoo.builtin.llm_tasks import Example, Task
from featcal.zoo.score.lm import LMZoo, _by_length, _device, pad_rows
from featcal.zoo.tokens import TokenRows, as_batch, masked_mean


class Seq2SeqRows(TokenRows):
    """``n`` prompts (``input_ids``, ``attention_mask``, right-padded) and their reference replies
    (``labels``, ``label_mask``), indexed together; :meth:`as_batch` is the model's batch."""

    def __init__(self, input_ids, attention_mask, labels, label_mask, start_id: int = 0):
        super().__init__(input_ids, attention_mask)
        if labels.dim() != 2 or labels.shape != label_mask.shape or len(labels) != len(input_ids):
            raise ValueError(f"labels {tuple(labels.shape)} and label_mask {tuple(label_mask.shape)} must be (n, T).")
        self.labels, self.label_mask, self.start_id = labels.long(), label_mask.long(), start_id

    def __getitem__(self, rows) -> "Seq2SeqRows":
        if isinstance(rows, int):
            rows = slice(rows, rows + 1 if rows != -1 else None)
        src, tgt = (
            TokenRows(self.input_ids[rows], self.attention_mask[rows]),
            TokenRows(self.labels[rows], self.label_mask[rows]),
        )
        src, tgt = src[:], tgt[:]  # each cut to its longest example
        return Seq2SeqRows(src.input_ids, src.attention_mask, tgt.input_ids, tgt.attention_mask, self.start_id)

    def __repr__(self) -> str:
        return f"Seq2SeqRows(n={len(self)}, max_len={self.input_ids.shape[1]}, max_reply={self.labels.shape[1]})"

    def to(self, device) -> "Seq2SeqRows":
        return Seq2SeqRows(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.labels.to(device),
            self.label_mask.to(device),
            self.start_id,
        )

    def decoder_input_ids(self) -> torch.Tensor:
        """The reply shifted right behind the decoder's start token (T5's teacher forcing)."""
        start = torch.full_like(self.labels[:, :1], self.start_id)
        return torch.cat([start, self.labels[:, :-1]], dim=1)

    def as_batch(self) -> dict[str, torch.Tensor]:
        mask = torch.cat([torch.ones_like(self.label_mask[:, :1]), self.label_mask[:, :-1]], dim=1)
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "decoder_input_ids": self.decoder_input_ids(),
            "decoder_attention_mask": mask,
        }


def encode_pairs(
    tokenizer, examples: Sequence[Example], max_source: int, max_target: int, start_id: int
) -> Seq2SeqRows:
    """The examples' prompts and reference replies tokenised (each with the tokenizer's end token);
    ``start_id`` is the decoder's start token (``config.decoder_start_token_id``)."""
    src = [tokenizer(ex.prompt, truncation=True, max_length=max_source)["input_ids"] for ex in examples]
    tgt = [tokenizer(ex.answer, truncation=True, max_length=max_target)["input_ids"] for ex in examples]
    ids, mask = pad_rows(src, tokenizer.pad_token_id, min_width=1)
    labels, label_mask = pad_rows(tgt, tokenizer.pad_token_id, min_width=1)  # an empty reply still has a first label
    return Seq2SeqRows(ids, mask, labels, label_mask, start_id)


@torch.no_grad()
def generate(
    model: nn.Module, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 32
) -> list[str]:
    """Greedy replies of an encoder-decoder to ``prompts`` as they stand, special tokens dropped,
    batched by prompt length (padding on the right, masked)."""
    model.eval()
    order = _by_length(prompts, tokenizer)
    out: list[str] = [""] * len(prompts)
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        enc = tokenizer([prompts[j] for j in idx], return_tensors="pt", padding=True, truncation=True).to(
            _device(model)
        )
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        for j, row in zip(idx, ids):
            out[j] = tokenizer.decode(row, skip_special_tokens=True)
    return out


def encoder_mean_hidden(model: nn.Module, inputs) -> torch.Tensor:
    """``(n, d)``: the encoder's last hidden states averaged over each prompt's tokens, L2-normalised."""
    batch = as_batch(inputs)
    dev = _device(model)
    ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
    hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    return torch.nn.functional.normalize(masked_mean(hidden, mask), dim=-1)


class Seq2SeqZoo(LMZoo):
    """An :class:`LMZoo` of encoder-decoder experts (see the module docstring)."""

    def replies(self, model: nn.Module, task: Task, examples: Sequence[Example], batch_size: int = 32) -> list:
        if task.kind != "generate":
            raise ValueError("an encoder-decoder zoo scores generated replies only (no choice tasks).")
        return generate(model, self.tokenizer, [ex.prompt for ex in examples], task.max_new_tokens, batch_size)

    def split(self, task: str, split: str):
        """``(inputs, labels)``; a label is the reference reply's first token (what :meth:`logits` predicts)."""
        x, _ = self.data[task].split(split)
        return x, x.labels[:, 0]

    @torch.no_grad()
    def logits(self, model: nn.Module, task: str, inputs) -> torch.Tensor:
        """``(n, V)``: the decoder's first-step logits (the reply's first token), what the app's
        accuracy, agreement and KL read."""
        batch = as_batch(inputs)
        dev = _device(model)
        start = batch["decoder_input_ids"][:, :1].to(dev)
        out = model(
            input_ids=batch["input_ids"].to(dev),
            attention_mask=batch["attention_mask"].to(dev),
            decoder_input_ids=start,
        )
        return out.logits[:, 0].float()

    def generate(self, model: nn.Module, prompts: Sequence[str], max_new_tokens: int = 48) -> list[str]:
        """Greedy replies of ``model`` to free prompts (the app's generate box)."""
        return generate(model, self.tokenizer, prompts, max_new_tokens)
