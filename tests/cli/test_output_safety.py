"""Nothing of the user's is lost (issue 24, items 1 and 9): --force and the app's Replace replace
only a directory featcal wrote, never an input or a folder of the user's files; a repeated
--expert is an error."""

import errno
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from featcal.cli.commands import main
from featcal.model.checkpoints import save_token_data
from featcal.util import outdir
from featcal.zoo.io import UnsafeOutputError, save_model

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def models(tmp_path):
    """A tiny base, two experts and a token file in one folder, beside the user's notes.txt."""
    import tiny

    base = tiny.tiny_llama()
    base.save_pretrained(tmp_path / "B")
    tiny.perturbed(base, 0.02, 1).save_pretrained(tmp_path / "M")
    tiny.perturbed(base, 0.02, 2).save_pretrained(tmp_path / "C")
    g = torch.Generator().manual_seed(0)
    save_token_data(
        tmp_path / "T.safetensors",
        {t: {"input_ids": torch.randint(0, 50, (4, 6), generator=g)} for t in ("math", "code")},
    )
    (tmp_path / "notes.txt").write_text("my notes")
    return tmp_path


def _calibrate(root: Path, out: Path, *extra) -> int:
    argv = ["calibrate", "--base", str(root / "B"), "--expert", f"math={root / 'M'}", "--expert", f"code={root / 'C'}"]
    return main([*argv, "--data", str(root / "T.safetensors"), "--out", str(out), "--lam", "0.1", "-q", *extra])


def test_force_never_replaces_an_input_or_the_folder_holding_them(models, capsys):
    before = _snapshot(models)
    assert _calibrate(models, models / "C", "--force") == 2  # --out is the expert C
    assert "is expert 'code'" in capsys.readouterr().err
    assert _calibrate(models, models, "--force") == 2  # --out holds base, experts and tokens
    assert "contains" in capsys.readouterr().err
    assert _calibrate(models, models / "C" / "sub", "--force") == 2  # --out inside an input
    assert "lies inside" in capsys.readouterr().err
    assert _snapshot(models) == before  # every input and notes.txt as they were


def test_force_replaces_featcal_output_but_not_user_files(models, capsys):
    out = models / "out"
    assert _calibrate(models, out) == 0
    assert (out / outdir.MARKER).is_file()
    assert _calibrate(models, out, "--force") == 0  # featcal's own output: replaced
    (out / "mine.txt").write_text("added by the user")
    assert _calibrate(models, out, "--force") == 2
    assert "mine.txt" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "added by the user"


def test_zoo_dir_as_its_own_output_is_refused(tiny_zoo_dir, tmp_path, capsys):
    import shutil

    zoo = tmp_path / "zoo"
    shutil.copytree(tiny_zoo_dir, zoo)
    before = _snapshot(zoo)
    for cmd in (["calibrate", "--n-per-task", "8"], ["merge"]):
        rc = main([*cmd, "--zoo", str(zoo), "--out", str(zoo), "--force", "-q"])
        assert rc == 2 and "the zoo" in capsys.readouterr().err
    assert main(["merge", "--zoo", str(zoo), "--out", str(zoo / "inside"), "--force", "-q"]) == 2
    assert _snapshot(zoo) == before


def test_save_model_with_force_never_deletes_a_folder_of_ordinary_files(tmp_path):
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "draft.tex").write_text("\\section{}")
    with pytest.raises(UnsafeOutputError, match="not written by featcal"):
        save_model(torch.nn.Linear(2, 2), folder, fmt="torch", force=True)
    assert _snapshot(folder) == {"draft.tex": b"\\section{}"}


def test_app_export_replace_refuses_a_folder_of_ordinary_files(tiny_zoo_dir, tmp_path):
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "draft.tex").write_text("mine")
    at = AppTest.from_file(APP, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = tiny_zoo_dir
    at.run()
    at.switch_page("pages/export.py").run()
    at.text_input(key="export_dir").set_value(str(folder)).run()
    assert at.warning and "not written by featcal" in at.warning[0].value
    assert not any(c.key == "export_replace" for c in at.checkbox)  # nothing offered to replace it
    save = next(b for b in at.button if b.label.startswith("Save"))
    assert save.disabled
    assert _snapshot(folder) == {"draft.tex": b"mine"}


def test_repeated_expert_is_an_error(models, capsys):
    argv = ["calibrate", "--base", str(models / "B"), "--expert", f"math={models / 'M'}"]
    rc = main(
        [*argv, "--expert", f"math={models / 'C'}", "--data", str(models / "T.safetensors"), "--out", str(models / "o")]
    )
    assert rc == 2 and "--expert math= is given twice" in capsys.readouterr().err


def test_marker_lists_the_files_written(tmp_path):
    out = save_model(torch.nn.Linear(2, 2), tmp_path / "m", fmt="torch", extra_files={"report.json": {"a": 1}})
    marker = json.loads((out / outdir.MARKER).read_text())
    assert marker["written_by"] == "featcal" and set(marker["files"]) == {
        "model.safetensors",
        "featcal_model.json",
        "report.json",
    }


def test_every_command_refuses_an_input_or_a_shipped_zoo_as_its_output(tiny_zoo_dir, tmp_path, capsys):
    """diagnose, compare, tune and study with --out on the zoo they read (or the saved model they
    diagnose) and --force replaced it with their tables, rc 0; featcal's shipped demo zoo (a legacy
    meta.json, no marker) counted as replaceable. Each is refused before any work, the bytes kept."""
    import shutil

    from featcal.zoo.builtin.demo import SHIPPED

    zoo = tmp_path / "zoo"
    shutil.copytree(tiny_zoo_dir, zoo)
    saved = tmp_path / "saved"
    assert main(["merge", "--zoo", str(zoo), "--out", str(saved), "-q"]) == 0
    before, before_saved, shipped = _snapshot(zoo), _snapshot(saved), _snapshot(SHIPPED)
    commands = [
        ["diagnose", "--zoo", str(zoo), "--n-per-task", "4"],
        ["compare", "--zoo", str(zoo), "--methods", "ta"],
        ["tune", "--zoo", str(zoo)],
        ["study", "sample-efficiency", "--zoo", str(zoo)],
    ]
    for cmd in commands:
        rc = main([*cmd, "--out", str(zoo), "--force", "-q"])
        assert rc == 2 and "the zoo" in capsys.readouterr().err, cmd
    rc = main(["diagnose", "--zoo", str(zoo), "--model", str(saved), "--out", str(saved), "--force", "-q"])
    assert rc == 2 and "--model" in capsys.readouterr().err
    for cmd in (["merge", "--zoo", str(zoo)], commands[0]):
        rc = main([*cmd, "--out", str(SHIPPED), "--force", "-q"])
        assert rc == 2 and "featcal's shipped zoos" in capsys.readouterr().err, cmd
    assert _snapshot(zoo) == before and _snapshot(saved) == before_saved and _snapshot(SHIPPED) == shipped


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_refused_write_is_one_line_with_the_way_forward(tiny_zoo_dir, tmp_path, capsys, monkeypatch, code):
    """Disk full, a read-only place or a forbidden one gave a raw OSError traceback."""
    import os

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "out" / "model.safetensors"))

    monkeypatch.setattr("featcal.cli.merge.write_output", refused)
    rc = main(["merge", "--zoo", tiny_zoo_dir, "--out", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"featcal: error: {os.strerror(code)} ({tmp_path / 'out' / 'model.safetensors'})")
    assert "choose a writable --out" in err


def test_a_sweep_folder_stopped_half_way_is_never_deleted_with_a_file_added_there(tmp_path):
    """A sweep's folder is marked as it is made, listing nothing yet (it was marked 'unlisted': all
    of it featcal's, so --force or the app's Replace took a file the user added with it); done, it
    lists its files. Either way a file the user added is never deleted."""
    out = outdir.fresh_dir(tmp_path / "sweep", force=False, kind="sweep")
    (out / "table.csv").write_text("featcal's")
    (out / "my_notes.txt").write_text("mine")  # the run stopped here; the user adds a file
    with pytest.raises(UnsafeOutputError, match="my_notes.txt"):
        outdir.fresh_dir(out, force=True, kind="sweep")
    (out / "my_notes.txt").unlink()
    outdir.mark(out, "sweep")  # a finished run lists its files: replaceable
    assert outdir.fresh_dir(out, force=True, kind="sweep") == out.resolve() and not any(
        p.name == "table.csv" for p in out.iterdir()
    )


def test_an_old_unlisted_sweep_folder_keeps_a_file_the_user_added_under_force(tmp_path):
    """An older featcal marked a sweep's folder 'unlisted' (files: null). --force over it deletes
    only what a sweep writes; a file of the user's there is refused, named, and kept byte for byte."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / outdir.MARKER).write_text(json.dumps({"written_by": "featcal", "kind": "sweep", "files": None}))
    (out / "table.csv").write_text("featcal's")
    (out / "sweep_parallel.html").write_text("featcal's")
    (out / "my_notes.txt").write_bytes(b"mine \x00\xff")
    with pytest.raises(UnsafeOutputError, match="my_notes.txt") as err:
        outdir.fresh_dir(out, force=True, kind="sweep")
    assert "table.csv" not in str(err.value) and "lists no files" in str(err.value)
    assert (out / "my_notes.txt").read_bytes() == b"mine \x00\xff" and (out / "table.csv").exists()
    (out / "my_notes.txt").unlink()  # moved away: now only featcal's names are there, and replaced
    assert outdir.fresh_dir(out, force=True, kind="sweep") == out.resolve()
    assert not (out / "table.csv").exists()
    # a kind featcal does not know: nothing in it counts as featcal's
    other = tmp_path / "other"
    other.mkdir()
    (other / outdir.MARKER).write_text(json.dumps({"written_by": "featcal", "kind": "tune", "files": None}))
    (other / "table.csv").write_text("x")
    with pytest.raises(UnsafeOutputError, match="table.csv"):
        outdir.remove_own(other)
    assert (other / "table.csv").read_text() == "x"


def test_a_work_directory_is_removed_only_when_it_holds_nothing_but_a_run_s_files(tmp_path):
    work = tmp_path / ".out.featcal-partial"
    (work / "blocks").mkdir(parents=True)
    (work / "model").mkdir()
    outdir.mark(work, "work", listed=False)
    for name in ("state.json", "streams-00001.safetensors", "streams.safetensors", "blocks/00000.safetensors"):
        (work / name).write_text("featcal's")
    (work / "model" / "config.json").write_text("featcal's")
    (work / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeOutputError, match="notes.txt"):
        outdir.remove_own(work)
    assert (work / "notes.txt").read_text() == "mine"
    (work / "notes.txt").unlink()
    outdir.remove_own(work)
    assert not work.exists()
