"""No file makes featcal run code (docs/security.md): every ``from_pretrained`` call in the library and
the app says ``trust_remote_code`` itself (False, or the user's own flag), so transformers never
falls back to asking on the terminal, where a "y" would run a downloaded or planted file; and a
zoo's ``model_kwargs`` cannot name a hub kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from featcal.model.allowed import check_model_kwargs

ROOT = Path(__file__).resolve().parents[2]
# calls whose keywords come in a dict that always holds trust_remote_code (the line says where)
VIA_DICT = {"featcal/zoo/store.py": 'kw |= {"use_safetensors": True, "trust_remote_code": False'}


def _calls_without_the_flag() -> list[str]:
    out = []
    for package in ("featcal", "diagnostics", "app"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            for node in ast.walk(ast.parse(text)):
                if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained"):
                    continue
                names = {k.arg for k in node.keywords}
                if "trust_remote_code" in names:
                    continue
                if None in names and rel in VIA_DICT and VIA_DICT[rel] in text:
                    continue
                out.append(f"{rel}:{node.lineno}")
    return out


def test_every_from_pretrained_call_says_trust_remote_code():
    assert _calls_without_the_flag() == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attn_implementation": "kernels-community/flash-attn2"}, "a hub kernel"),
        ({"trust_remote_code": True}, "not allowed from a file"),
        ({"add_pooling_layer": "no"}, "take true or false"),
    ],
)
def test_a_file_cannot_name_a_hub_kernel_or_code(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_model_kwargs(kwargs, "zoo 'z': meta.json's model_kwargs")
    assert check_model_kwargs({"attn_implementation": "sdpa", "add_pooling_layer": False}, "z") == {
        "attn_implementation": "sdpa",
        "add_pooling_layer": False,
    }
