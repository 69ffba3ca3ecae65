"""The Zoo page's Your models flow in a real browser at 1280 px wide (issue 40): a tiny CLIPModel
base ends on the Zoo page of the new zoo (and a reload opens it again), a CLIPVisionModel base on a
refusal naming the fields to change and then (features pooled, a heads file) on its Zoo page, a
tiny Llama with a PEFT adapter on the featcal calibrate command; each refusal is shown whole, not
cut at the page's edge. Screenshots go to the test's tmp dir and artifacts/screenshots/ (and /work/briefs/shots/ when
that folder exists, for a reviewer)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from browser_kit import EXCEPTION, SHOTS, _idle, _open, explain_wait
from test_browser import browser, server  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))  # the zoo tests' tiny models
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]

WIDTH = 1280
REVIEW = Path("/work/briefs/shots")
FIELDS = {
    "name": "zoo name",
    "base": "base model directory",
    "data": "data folder (one dataset per task)",
    "experts": "experts folder (one sub-folder per task, named as the datasets)",
    "heads": "heads file (optional: safetensors of <task>.weight; default zero-shot from the base's text tower)",
    "folder": "save the YAML in (default: featcal's cache)",
}
ERROR = '[data-testid="stAlertContentError"]'
TINY_MS = 600_000  # stops a hang only: the form's zoos are tiny models, loaded in seconds
SUCCESS = '[data-testid="stAlertContentSuccess"]'


def _fill(page, values: dict) -> None:
    for key, value in values.items():
        page.get_by_label(FIELDS[key], exact=True).fill(value)


def _on_zoo_page(zoo: str) -> str:
    """A page condition: the Zoo page of the zoo named ``zoo`` is drawn (its heading)."""
    return f"[...document.querySelectorAll('h1')].some(e => e.innerText.startsWith('Zoo · {zoo}'))"


def _submit(page, server, zoo: str | None = None) -> None:  # noqa: F811
    """Press the form's button and wait for what it leads to: the Zoo page of the zoo named
    ``zoo``, or (no ``zoo``) a new refusal. Either way an exception on the page, or a refusal
    where a zoo page was due, fails at once with its text; a wait in vain fails with the page's
    text and the server's threads (:func:`browser_kit.explain_wait`)."""
    page.evaluate(f"document.querySelectorAll('{ERROR}').forEach(e => e.dataset.before = '1')")
    page.get_by_role("button", name="Write the zoo YAML and open it").click()
    refused = f"[...document.querySelectorAll('{ERROR}')].some(e => !e.dataset.before)"
    crashed = f"document.querySelector('{EXCEPTION}') !== null"
    explain_wait(
        page, server[1], " || ".join([_on_zoo_page(zoo), refused, crashed] if zoo else [refused, crashed]), TINY_MS
    )
    _idle(page, TINY_MS, server[1])
    assert page.locator(EXCEPTION).count() == 0, page.locator(EXCEPTION).first.inner_text()
    if zoo is not None:
        assert page.locator(ERROR).count() == 0, page.locator(ERROR).first.inner_text()


def _shot(page, tmp_path: Path, name: str) -> None:
    """A screenshot of the page as it is, into the test's tmp dir and the screenshot folders."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    for folder in (SHOTS, REVIEW if REVIEW.parent.is_dir() else None):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / path.name)


def _whole(page, selector: str) -> str:
    """The element's text, after checking that none of it runs past its box or the viewport."""
    el = page.locator(selector).first
    el.scroll_into_view_if_needed()
    box = el.evaluate(
        "e => ({sw: e.scrollWidth, cw: e.clientWidth, right: e.getBoundingClientRect().right, vw: innerWidth})"
    )
    assert box["sw"] <= box["cw"] + 1 and box["right"] <= box["vw"], box
    return el.inner_text()


def _form(browser, server, tmp_path):  # noqa: F811
    context = browser.new_context(viewport={"width": WIDTH, "height": 1400})
    page = _open(context, server[0], proc=server[1])
    page.get_by_text("Your models").first.click()
    return context, page


def test_a_clip_model_base_ends_on_its_zoo_page(server, browser, tmp_path):  # noqa: F811
    from test_userspec import write_user_models

    root = write_user_models(tmp_path / "mine")
    context, page = _form(browser, server, tmp_path)
    _fill(page, {"name": "tiny-mine", **{k: str(root / k) for k in ("base", "data", "experts")}})
    _fill(page, {"folder": str(tmp_path / "zoos")})
    _submit(page, server, "tiny-mine")
    assert (tmp_path / "zoos" / "tiny-mine.yaml").is_file()
    assert "tiny-mine" in page.title()  # the tab names the zoo
    assert page.locator('[data-testid="stCode"]').first.inner_text().count("experts:") == 1  # the YAML, to keep
    assert "Preset clip" in _whole(page, SUCCESS)
    _shot(page, tmp_path, "yours-clip-model")
    assert "zoo_path=" in page.url  # the URL holds the new zoo: a reload (or the link) opens it again
    page.reload()
    explain_wait(page, server[1], f"{_on_zoo_page('tiny-mine')} || document.querySelector('{ERROR}') !== null", TINY_MS)
    assert page.locator(ERROR).count() == 0, page.locator(ERROR).first.inner_text()
    context.close()


def test_a_clip_vision_base_is_refused_whole_then_loads_with_pooled_features(server, browser, tmp_path):  # noqa: F811
    from test_userspec_checks import write_vision_models

    root = write_vision_models(tmp_path / "vis")
    context, page = _form(browser, server, tmp_path)
    _fill(page, {"name": "tiny-vis", **{k: str(root / k) for k in ("base", "data", "experts")}})
    _fill(page, {"folder": str(tmp_path / "zoos")})
    _submit(page, server)
    text = _whole(page, ERROR)
    assert "visual_projection" in text and "features: pooled" in text and text.rstrip().endswith(").")
    assert not (tmp_path / "zoos" / "tiny-vis.yaml").exists()
    _shot(page, tmp_path, "yours-clip-vision-refused")
    box = page.locator('[data-testid="stSelectbox"]').filter(has_text="features")
    box.locator("input").click()  # a selectbox: focus it, type the option, take it
    page.keyboard.type("pooled")
    page.get_by_role("option", name="pooled").wait_for()
    page.keyboard.press("Enter")  # (the zoo page of tiny-vis below shows it was taken)
    _fill(page, {"heads": str(root / "heads.safetensors")})
    _submit(page, server, "tiny-vis")
    assert (tmp_path / "zoos" / "tiny-vis.yaml").is_file()
    assert "Preset clip" in _whole(page, SUCCESS)  # shown in the shot, with the YAML under it
    _shot(page, tmp_path, "yours-clip-vision-pooled")
    context.close()


def test_a_llama_with_a_peft_adapter_ends_on_the_featcal_calibrate_command(server, browser, tmp_path):  # noqa: F811
    from test_userspec_checks import write_llama_models

    root = write_llama_models(tmp_path / "llama")
    context, page = _form(browser, server, tmp_path)
    _fill(page, {"name": "tiny-llama", **{k: str(root / k) for k in ("base", "data", "experts")}})
    _submit(page, server)
    text = _whole(page, ERROR)
    assert "generative language model" in text and "another architecture" not in text
    command = _whole(page, '[data-testid="stCode"]')
    assert command.startswith("featcal calibrate --base ") and "--out OUT_DIR" in command
    _shot(page, tmp_path, "yours-llama-peft")
    context.close()
