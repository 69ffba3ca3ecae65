"""The README's Python snippets run as written (on the shipped demo zoo, in a scratch
directory): every ```python block, in order, each in a fresh namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [pytest.mark.demo_zoo, pytest.mark.slow]


def snippets(text: str) -> list[str]:
    """The bodies of the markdown's ```python blocks."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_has_python_snippets():
    blocks = snippets(README.read_text())
    assert len(blocks) >= 2 and all("import" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(snippets(README.read_text()))))
def test_a_readme_snippet_runs_as_written(index, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)  # what a snippet writes stays here
    torch.set_num_threads(1)
    code = snippets(README.read_text())[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip(), "a snippet prints what it computed"
