"""The featcal command line on a tiny zoo directory: the table of subcommands, outputs, clean errors."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featcal.cli import commands as cli
from featcal.cli.calibrate import config_from_args
from featcal.zoo import load_any
from featcal.zoo.core import evaluate

REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_clean_error(rc, err, *needles):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


ALL = ("zoo", "merge", "calibrate", "eval", "diagnose", "tune", "study", "compare", "reproduce", "app")


def test_the_table_holds_every_subcommand_and_each_parses(capsys):
    assert tuple(cli.COMMANDS) == ALL
    for name, (help_text, load) in cli.COMMANDS.items():
        add_arguments, run = load()
        assert callable(add_arguments) and callable(run) and help_text, name
        with pytest.raises(SystemExit) as exc:
            cli.build_parser(name).parse_args([name, "--help"])
        assert exc.value.code == 0, name
        assert help_text.split()[0] in capsys.readouterr().out, name
    args = cli.build_parser("merge").parse_args(["merge", "--out", "x"])
    assert args.func is cli.COMMANDS["merge"][1]()[1]  # the table's run is what main calls


def _imports(*argv: str, code: str | None = None) -> set[str]:
    """The modules ``python -m featcal ARGV`` (or ``python -c CODE``) imports, read from ``-X importtime``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-X", "importtime", *(["-c", code] if code else ["-m", "featcal", *argv])]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [["--help"], ["app", "--help"]])
def test_help_does_not_import_torch(argv):
    """Only the subcommand that runs is loaded: ``featcal --help`` lists the table without it."""
    imported = _imports(*argv)
    assert "featcal.cli.commands" in imported and "torch" not in imported
    assert "featcal.cli.calibrate" not in imported and "diagnostics" not in imported


def test_the_app_launcher_starts_streamlit_without_torch():
    """``featcal app`` becomes the Streamlit server (exec): it must not have loaded torch first, and it
    hands the server the repository on PYTHONPATH (a first request to any page imports ``app``)."""
    code = (
        "import os, sys\n"
        "def execve(exe, cmd, env):\n"
        "    assert cmd[1:4] == ['-m', 'streamlit', 'run'] and 'torch' not in sys.modules\n"
        "    assert os.path.isdir(os.path.join(env['PYTHONPATH'].split(os.pathsep)[0], 'app', 'pages'))\n"
        "    raise SystemExit(0)\n"
        "os.execve = execve\n"
        "from featcal.cli.commands import main\n"
        "main(['app', '--port', '8599'])\n"
    )
    imported = _imports(code=code)
    assert "featcal.cli.app" in imported and "torch" not in imported


def test_zoo_says_built_in_when_it_built():
    from featcal.cli.zoo import _built_since

    started = datetime.datetime(2026, 12, 3, 18, 0, 0, tzinfo=datetime.timezone.utc)
    assert _built_since({"built_at": "2026-12-03T18:11:30+00:00"}, started)  # built by this command
    assert _built_since({"built_at": "2026-12-03T18:00:00+00:00"}, started)
    assert not _built_since({"built_at": "2026-12-01T09:00:00+00:00"}, started)  # found in the cache
    assert not _built_since({}, started)  # the shipped or a user's zoo: never built here


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if re.match(r"    \S", line)]  # "    name  help"
    assert tuple(listed) == ALL


def test_merge_writes_a_model_that_eval_scores(tiny_zoo_dir, tmp_path, capsys):
    out = tmp_path / "ta"
    rc, stdout, _ = _run(
        capsys,
        "merge",
        "--zoo",
        tiny_zoo_dir,
        "--method",
        "task_arithmetic",
        "--param",
        "scale=0.3",
        "--out",
        str(out),
        "-q",
    )
    assert rc == 0 and (out / "model.safetensors").is_file()
    assert json.loads((out / "merge.json").read_text())["params"] == {"scale": 0.3}

    scores = tmp_path / "scores.json"
    rc, stdout, _ = _run(capsys, "eval", "--zoo", tiny_zoo_dir, "--model", str(out), "--json", str(scores), "-q")
    assert rc == 0 and "| ta |" in stdout
    doc = json.loads(scores.read_text())
    zoo = load_any(tiny_zoo_dir)
    expected = evaluate(zoo.merged("task_arithmetic", scale=0.3), zoo)
    assert doc["models"]["ta"]["per_task"] == pytest.approx(expected)
    assert doc["split"] == "test" and set(doc["models"]["ta"]) >= {"average", "normalized_average"}


def test_merge_runs_the_new_mergers(tiny_zoo_dir, tmp_path, capsys):
    from featcal import merge_with_data
    from featcal.zoo.io import load_model

    zoo = load_any(tiny_zoo_dir)
    out = tmp_path / "iso"
    rc, _, _ = _run(
        capsys, "merge", "--zoo", tiny_zoo_dir, "--method", "iso_c", "--param", "scale=1.2", "--out", str(out), "-q"
    )
    assert rc == 0
    want = zoo.merged("iso_c", scale=1.2).state_dict()
    got = load_model(str(out), like=zoo.base).state_dict()
    assert all(torch.allclose(got[k], v) for k, v in want.items())

    # A data-using one reads the zoo's calib split: the sample --n-per-task/--seed name.
    out = tmp_path / "rmpp"
    argv = ["--method", "regmean_plusplus", "--param", "reduce_nondiag=0.5", "--n-per-task", "8", "--seed", "3"]
    rc, _, _ = _run(capsys, "merge", "--zoo", tiny_zoo_dir, *argv, "--out", str(out), "-q")
    assert rc == 0
    doc = json.loads((out / "merge.json").read_text())
    assert doc["params"] == {"reduce_nondiag": 0.5} and doc["n_per_task"] == 8 and doc["seed"] == 3
    data = zoo.calib_data(8, seed=3)
    want = merge_with_data(
        "regmean_plusplus", base=zoo.base, experts=zoo.experts, calib_data=data, reduce_nondiag=0.5, progress=False
    ).state_dict()
    got = load_model(str(out), like=zoo.base).state_dict()
    assert all(torch.allclose(got[k], v, atol=1e-6) for k, v in want.items())

    rc, _, err = _run(
        capsys,
        "merge",
        "--zoo",
        tiny_zoo_dir,
        "--method",
        "regmean",
        "--param",
        "scale=1",
        "--out",
        str(tmp_path / "x"),
    )
    _assert_clean_error(rc, err, "regmean takes no parameter 'scale'; it takes reduce_nondiag")


def test_eval_without_model_scores_base_experts_merge(tiny_zoo_dir, capsys):
    rc, out, _ = _run(capsys, "eval", "--zoo", tiny_zoo_dir, "--merge", "average", "--split", "val", "-q")
    assert rc == 0
    assert [line.split("|")[1].strip() for line in out.splitlines()[2:5]] == ["base", "experts", "average"]


def test_calibrate_writes_model_and_report(tiny_zoo_dir, tmp_path, capsys):
    out = tmp_path / "fc"
    rc, _, _ = _run(
        capsys,
        "calibrate",
        "--zoo",
        tiny_zoo_dir,
        "--merge",
        "task_arithmetic",
        "--lam",
        "0.1",
        "--n-per-task",
        "32",
        "--preset",
        "none",
        "--out",
        str(out),
        "-q",
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["report"]["config"]["lam"] == 0.1 and report["n_per_task"] == 32
    assert report["report"]["tasks"] == load_any(tiny_zoo_dir).tasks
    saved = config_from_args(
        cli.build_parser("calibrate").parse_args(["calibrate", "--out", "x", "--preset", "clip", "--alpha", "0.25"])
    )
    assert saved.alpha == 0.25 and saved.token_weights is not None  # the clip preset, overridden


def test_clean_errors(tiny_zoo_dir, tmp_path, capsys):
    rc, _, err = _run(capsys, "eval", "--zoo", str(tmp_path / "missing"))
    _assert_clean_error(rc, err, "does not exist")

    (tmp_path / "exists").mkdir()
    rc, _, err = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--out", str(tmp_path / "exists"))
    _assert_clean_error(rc, err, "--force")

    rc, _, err = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--method", "magic", "--out", str(tmp_path / "m"))
    _assert_clean_error(rc, err, "unknown merge method 'magic'", "task_arithmetic")

    rc, _, err = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--param", "sclae=0.3", "--out", str(tmp_path / "m"))
    _assert_clean_error(rc, err, "sclae")

    rc, _, err = _run(capsys, "calibrate", "--zoo", tiny_zoo_dir, "--lam", "-1", "--out", str(tmp_path / "c"))
    _assert_clean_error(rc, err, "lam")

    rc, _, err = _run(capsys, "eval", "--zoo", tiny_zoo_dir, "--model", str(tmp_path / "nomodel"))
    _assert_clean_error(rc, err, "nomodel")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "model.safetensors").write_bytes(b"")  # a file where the directory is meant
    rc, _, err = _run(capsys, "eval", "--zoo", tiny_zoo_dir, "--model", str(tmp_path / "saved" / "model.safetensors"))
    _assert_clean_error(rc, err, "is a file; give the model's directory", str(tmp_path / "saved"))
    cfg = tmp_path / "saved" / "config.json"
    cfg.write_text("{}")
    data = str(tmp_path / "d.safetensors")
    rc, _, err = _run(
        capsys,
        "calibrate",
        "--base",
        str(cfg),
        "--expert",
        f"t={tmp_path}",
        "--data",
        data,
        "--out",
        str(tmp_path / "c"),
    )
    _assert_clean_error(rc, err, "is a file; give the model's directory")
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


def test_force_replaces_only_featcal_output(tiny_zoo_dir, tmp_path, capsys):
    out = tmp_path / "m"
    rc, _, _ = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--out", str(out), "-q")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    rc, _, _ = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--out", str(out), "--force", "-q")
    assert rc == 0 and (out / "model.safetensors").stat().st_mtime_ns != stamp
    # a folder of the user's own files is never replaced, --force or not
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "old.txt").write_text("old")
    rc, _, err = _run(capsys, "merge", "--zoo", tiny_zoo_dir, "--out", str(mine), "--force", "-q")
    _assert_clean_error(rc, err, "not written by featcal")
    assert (mine / "old.txt").read_text() == "old" and sorted(p.name for p in mine.iterdir()) == ["old.txt"]


def test_python_dash_m(tiny_zoo_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shown = subprocess.run(
        [sys.executable, "-m", "featcal", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800
    )
    listed = [line.split()[0] for line in shown.stdout.splitlines() if re.match(r"    \S", line)]
    assert shown.returncode == 0 and tuple(listed) == ALL, shown.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "featcal", "eval", "--zoo", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("featcal: error: zoo") and "Traceback" not in proc.stderr


def test_the_cli_checks_params_before_any_work(tiny_zoo_dir, tmp_path, capsys):
    out = tmp_path / "m"
    rc, _, err = _run(
        capsys, "merge", "--zoo", tiny_zoo_dir, "--method", "ta", "--param", "scale=big", "--out", str(out)
    )
    assert rc == 2 and "task_arithmetic: parameter 'scale' takes a number, got 'big'" in err and not out.exists()
    rc, _, err = _run(
        capsys, "calibrate", "--zoo", tiny_zoo_dir, "--merge", "ta", "--param", "density=0.1", "--out", str(out)
    )
    assert rc == 2 and "task_arithmetic takes no parameter 'density'" in err and not out.exists()
    # a good one reaches the merge
    argv = ["calibrate", "--zoo", tiny_zoo_dir, "--param", "scale=0.4", "--n-per-task", "8", "--out", str(out), "-q"]
    rc, _, err = _run(capsys, *argv)
    assert rc == 0, err
    assert '"scale": 0.4' in (out / "report.json").read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--merge-param", "scale=0.4"],
        ["tune", "--merge-param", "scale=0.4"],
        ["diagnose", "--scale", "0.4"],
    ],
)
def test_the_old_spellings_of_param_are_gone(argv, tiny_zoo_dir, tmp_path, capsys):
    """``--merge-param`` and ``diagnose --scale`` were kept for one release; write ``--param``."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--zoo", tiny_zoo_dir, "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


def test_merge_runs_adamerging_and_fisher_through_the_zoos_heads(tiny_zoo_dir, tmp_path, capsys):
    from featcal import merge_with_data
    from featcal.baselines.registry import zoo_logits
    from featcal.zoo.io import load_model

    zoo = load_any(tiny_zoo_dir)
    for method, params in (("adamerging", ["granularity=task", "steps=3"]), ("fisher", ["batch=4"])):
        out = tmp_path / method
        argv = ["merge", "--zoo", tiny_zoo_dir, "--method", method, "--n-per-task", "8", "--out", str(out), "-q"]
        for p in params:
            argv += ["--param", p]
        rc, _, err = _run(capsys, *argv)
        assert rc == 0, err
        name = "fisher_merging" if method == "fisher" else method
        kw = {"granularity": "task", "steps": 3} if method == "adamerging" else {"batch": 4}
        want = merge_with_data(
            name,
            base=zoo.base,
            experts=zoo.experts,
            calib_data=zoo.calib_data(8),
            logits=zoo_logits(zoo),
            progress=False,
            **kw,
        ).state_dict()
        got = load_model(str(out), like=zoo.base).state_dict()
        assert all(torch.allclose(got[k], v, atol=1e-5) for k, v in want.items()), method


def test_tune_and_study_take_the_llama_preset_and_float64_statistics():
    """``--preset llama-3b --stats-dtype float64``: the paper's Llama switches (RMSNorm scales kept
    merged) at its own anchor (lam as given), statistics in float64 (what lam 1e-5 needs)."""
    import argparse

    from featcal.cli.sweep import _featcal_config, add_tune_arguments

    p = add_tune_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--preset", "llama-3b", "--stats-dtype", "float64", "--lam", "1e-5", "--out", "x"])
    cfg = _featcal_config(args)
    assert (cfg.lam, cfg.rho, cfg.alpha, cfg.layernorm, cfg.stats_dtype) == (1e-5, 0.5, 0.15, False, torch.float64)
    clip = _featcal_config(p.parse_args(["--out", "x", "--rho", "1.5"]))
    assert (clip.lam, clip.rho, clip.alpha) == (0.05, 1.5, 0.3)  # the CLIP anchor, rho as given
    assert _featcal_config(p.parse_args(["--out", "x"])).stats_dtype == torch.float32  # the default
    llama = p.parse_args(["--preset", "llama-3b", "--out", "x"])
    assert _featcal_config(llama).stats_dtype == torch.float64  # the llama-3b preset's default
    llama.stats_dtype = "float32"
    assert _featcal_config(llama).stats_dtype == torch.float32  # a user's choice kept


def test_tune_and_study_without_preset_take_the_zoos_own(capsys):
    """No ``--preset``: the zoo's (featcal.config.preset_for_zoo, as the app and ``featcal compare``):
    llama-3b with float64 statistics on an LLM zoo, not CLIP's token weights on its first token; a
    preset given is kept."""
    import argparse
    from types import SimpleNamespace

    from featcal.cli.sweep import _featcal_config, _zoo_preset, add_study_arguments, add_tune_arguments
    from featcal.config import preset_config
    from tiny import tiny_hf_clip, tiny_llama

    llm, clip = SimpleNamespace(base=tiny_llama()), SimpleNamespace(base=tiny_hf_clip())
    for add, extra in ((add_tune_arguments, []), (add_study_arguments, ["sample-efficiency"])):
        p = add(argparse.ArgumentParser())
        args = p.parse_args([*extra, "--out", "x"])
        _zoo_preset(args, llm)
        assert args.preset == "llama-3b" and _featcal_config(args) == preset_config("llama-3b")
        assert _featcal_config(args).stats_dtype == torch.float64
        args = p.parse_args([*extra, "--out", "x"])
        _zoo_preset(args, clip)
        assert _featcal_config(args) == preset_config("clip")
        chosen = p.parse_args([*extra, "--preset", "none", "--out", "x"])
        _zoo_preset(chosen, llm)
        assert chosen.preset == "none"
    assert "preset 'llama-3b' (this zoo's" in capsys.readouterr().err


def test_tune_and_study_read_the_one_table_of_presets(capsys):
    """``featcal tune --preset`` offers featcal.config.PRESETS, each the config ``featcal calibrate
    --preset`` makes; ``default`` (tune's old name for ``none``) still works, with a warning."""
    import argparse

    from featcal.cli.sweep import _featcal_config, add_tune_arguments
    from featcal.config import PRESETS, preset_config

    p = add_tune_arguments(argparse.ArgumentParser())
    for name in PRESETS:
        assert _featcal_config(p.parse_args(["--preset", name, "--out", "x"])) == preset_config(name)
    old = p.parse_args(["--preset", "default", "--out", "x"])
    assert old.preset == "none" and _featcal_config(old) == preset_config("none")
    err = capsys.readouterr().err
    assert "--preset default is deprecated" in err and "write --preset none" in err
    with pytest.raises(SystemExit):
        p.parse_args(["--preset", "gpt", "--out", "x"])
