"""Tokenised text as zoo inputs: rows of token ids with their padding mask.

A text task's split holds :class:`TokenRows` where an image task holds an
``(n, C, H, W)`` tensor. It behaves like that tensor where the zoo's code touches
it (``len``, row indexing and slicing, ``split``, ``to``), and
:meth:`TokenRows.as_batch` turns it into the dict batch ``{input_ids,
attention_mask}`` that :func:`featcal.calibrate` and Hugging Face encoders take
(``model(**batch)``; the mask keeps padding out of the statistics).
"""

from __future__ import annotations

import torch


class TokenRows:
    """``n`` examples of token ids ``(n, L)`` and their attention mask ``(n, L)`` (1 = token,
    0 = padding, padding on the right). ``len`` is ``n``; indexing selects examples, and
    every selection is cut to its longest example, so a batch carries no all-padding column."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"input_ids and attention_mask must both be (n, L); got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}."
            )
        self.input_ids = input_ids.long()
        self.attention_mask = attention_mask.long()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows) -> "TokenRows":
        if isinstance(rows, int):
            rows = slice(rows, rows + 1 if rows != -1 else None)
        ids, mask = self.input_ids[rows], self.attention_mask[rows]
        width = int(mask.sum(1).max()) if len(mask) else 0  # longest example of the selection
        return TokenRows(ids[:, :width], mask[:, :width])

    def __repr__(self) -> str:
        return f"TokenRows(n={len(self)}, max_len={self.input_ids.shape[1]})"

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def split(self, size: int) -> list["TokenRows"]:
        """Consecutive batches of ``size`` examples (the last may be smaller), as ``Tensor.split``."""
        return [self[i : i + size] for i in range(0, len(self), size)]

    def to(self, device) -> "TokenRows":
        return TokenRows(self.input_ids.to(device), self.attention_mask.to(device))

    def as_batch(self) -> dict[str, torch.Tensor]:
        """``{"input_ids": (n, L), "attention_mask": (n, L)}``: a batch for ``model(**batch)``."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def as_batch(inputs):
    """A zoo split's inputs as a model batch: :class:`TokenRows` become their dict batch,
    anything else (an image tensor, a dict) is returned unchanged."""
    return inputs.as_batch() if isinstance(inputs, TokenRows) else inputs


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(n, T, d), (n, T) -> (n, d)``: the mean of each example's hidden states over its
    tokens, padding left out (what sentence-transformers' mean pooling computes)."""
    w = mask.to(hidden.dtype).unsqueeze(-1)  # (n, T, 1)
    return (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)
