"""Model skeletons: a model built from its ``config.json`` with every parameter on the ``meta``
device (no memory, no init cost), and its blocks filled from a checkpoint and released again
one at a time (for :mod:`featcal.streaming`: merges bigger than memory)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

from featcal.model.allowed import library_model_class


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the ``meta`` device (no memory, no init
    cost); buffers stay real (rotary frequencies and the like are computed, not stored)."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(ckpt, trust_remote_code: bool = False) -> nn.Module:
    """The model class the ``config.json`` of ``ckpt`` (a :class:`~featcal.model.checkpoints.Checkpoint`)
    names (``architectures[0]``), built from the config with its parameters on ``meta``, in eval
    mode. A class of the directory's own code (``auto_map``) only with ``trust_remote_code`` (the
    user's own flag; never read from a file)."""
    import transformers

    where = f"{ckpt.role} {str(ckpt.path)!r}"
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(ckpt.config_dir), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except ValueError as err:
        if "custom code" not in str(err):
            raise
        raise ValueError(
            f"{where}: config.json needs the directory's own Python code (auto_map); featcal runs it only "
            "when you pass --trust-remote-code (trust_remote_code=True) yourself."
        ) from None
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{where}: config.json names no architecture; save the model with save_pretrained.")
    auto = {k: v for k, v in (getattr(config, "auto_map", None) or {}).items() if k.startswith("AutoModel")}
    own = next((k for k, v in auto.items() if str(v).rsplit(".", 1)[-1] == archs[0]), None)
    if trust_remote_code and own is not None and hasattr(transformers, own):
        with params_on_meta():
            return getattr(transformers, own).from_config(config, trust_remote_code=trust_remote_code).eval()
    cls = library_model_class(archs[0], where)
    with params_on_meta():
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    return model.eval()


def release(module: nn.Module) -> None:
    """Put every parameter of ``module`` back on ``meta`` (its memory is freed)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type != "meta":
                m._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
                )


def fill(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Give ``module`` these parameters and persistent buffers (names relative to it; every
    one it has must be there), taking the tensors as they are."""
    module.load_state_dict(dict(tensors), strict=True, assign=True)
