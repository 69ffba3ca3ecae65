"""Eval mode for a while, with every module's own training flag restored afterwards.

``Module.eval()`` / ``Module.train(mode)`` set one flag on every submodule, so a model
with mixed flags (one block frozen in eval mode, the rest training) would come back
all training. :func:`eval_mode` records the submodules that were training and gives
exactly those their flag back.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch import nn


def to_eval(*models: nn.Module) -> Callable[[], None]:
    """Put every submodule of ``models`` in eval mode; returns the function that restores
    them (for code that cannot wrap its work in :func:`eval_mode`'s ``with`` block)."""
    training = [m for model in models for m in model.modules() if m.training]
    for m in training:
        m.training = False

    def restore() -> None:
        for m in training:
            m.training = True

    return restore


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """``models`` in eval mode inside the ``with`` block; each submodule's training flag
    is restored exactly when it ends, whether or not it raised."""
    restore = to_eval(*models)
    try:
        yield
    finally:
        restore()
