"""What a file may name: a model class of ``transformers`` itself and keyword arguments for
``from_pretrained`` from an allow-list. A zoo's ``meta.json`` and a checkpoint's ``config.json`` are
data; nothing in them decides what code runs (docs/security.md)."""

from __future__ import annotations

from typing import Mapping

# Keyword arguments a file (a zoo's meta.json) may pass to ``from_pretrained``: none of them
# loads or runs anything (``trust_remote_code`` comes only from the user's own flag).
MODEL_KWARGS = frozenset({"add_pooling_layer", "attn_implementation", "use_safetensors"})
# transformers' own attention implementations: any other string names a kernel on the hub, which
# transformers would download and import.
ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"})


def library_model_class(name: str, where: str):
    """The ``transformers`` model class called ``name`` (a ``PreTrainedModel`` subclass that the
    library itself defines: never an ``Auto*`` class, which could reach a directory's own code)."""
    import transformers

    cls = getattr(transformers, str(name), None) if str(name).isidentifier() else None
    ok = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
    if not ok or not cls.__module__.startswith("transformers."):
        raise ValueError(
            f"{where}: {name!r} is not a model class of transformers; featcal builds only the library's own "
            "model classes (e.g. LlamaForCausalLM, CLIPVisionModel), named in config.json's architectures."
        )
    return cls


def check_model_kwargs(kwargs: Mapping, where: str) -> dict:
    """``kwargs`` for ``from_pretrained`` read from a file: only :data:`MODEL_KWARGS` (no
    ``trust_remote_code``, no ``code_revision``, nothing that loads other files)."""
    bad = sorted(str(k) for k in kwargs if k not in MODEL_KWARGS)
    if bad:
        raise ValueError(
            f"{where}: model keyword arguments {bad} are not allowed from a file (allowed: "
            f"{sorted(MODEL_KWARGS)}); trust_remote_code in particular is only taken from the user's own flag."
        )
    attention = kwargs.get("attn_implementation")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(
            f"{where}: attn_implementation {attention!r} is not one of transformers' own ({sorted(ATTENTION)}); "
            "another name is a hub kernel, which featcal never downloads or imports from a file's word."
        )
    wrong = sorted(
        k for k in ("add_pooling_layer", "use_safetensors") if k in kwargs and not isinstance(kwargs[k], bool)
    )
    if wrong:
        raise ValueError(f"{where}: {wrong} take true or false.")
    return dict(kwargs)
