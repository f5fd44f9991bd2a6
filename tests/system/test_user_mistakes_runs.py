"""A table of a user's mistakes with runs, configs, presets and files: one line, exit 2, nothing changed.

Each case runs ``meta-consensus`` (its ``main``, in this process) in a fresh folder that holds a
user's files (configs, an earlier run, a run without checkpoints, an empty folder), and checks
that stderr is one line holding the case's phrase, that the exit code is 2, and that no file
changed: the folder's files (path, size, mtime, hash) are the same before and after, and no run
folder was left behind. Below the table: what the same mistakes do from Python (a start that
fails removes what it created, a task from Python is recorded so that the config never names
another task), the presets shipped as package data, and ``merge`` of a relative orbax path.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path

import pytest
from system_helpers import SMALL

from meta_consensus import cli, config
from meta_consensus.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: (size, mtime, hash) of a file, "dir" for a folder."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = ("dir",)
        for f in filenames:
            p = Path(dirpath, f)
            st = p.stat()
            out[os.path.relpath(p, root)] = (
                st.st_size,
                st.st_mtime_ns,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return out


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _user_files(root: Path) -> None:
    """The files a user has around: configs of their own, an earlier run, a run without checkpoints."""
    (root / "user.toml").write_text('[byzantine]\nnodes = [6, 7]\nattack = "alie"\noptions = { z = 2.0 }\n')
    (root / "unknown_preset.toml").write_text('preset = "nope"\nrounds = 3\n')
    (root / "preset_number.toml").write_text("preset = 3\n")
    (root / "preset_bad_key.toml").write_text('preset = "robust"\nno_such_key = 1\n')
    (root / "python_task.toml").write_text('name = "again"\n[task]\nname = "<python object: custom>"\n')
    (root / "a_folder").mkdir()
    taken = root / "runs" / "taken"
    taken.mkdir(parents=True)
    (taken / "config.toml").write_text('name = "taken"\n')
    (taken / "metrics.jsonl").write_text("")
    bare = root / "runs" / "bare"
    (bare / "checkpoints").mkdir(parents=True)
    (bare / "config.toml").write_text('name = "bare"\n')
    (root / "runs" / "empty").mkdir()


SMALL_SETS = _sets(*SMALL, "rounds=1", "dp.enabled=false", "output_dir=runs")

# (argv, the phrase the one line must hold); "{small}" stands for the small settings of a run
# (cases that get past the config check and build the run, so that they cost little).
CASES = [
    # Runs: --resume, names, run folders.
    (["run", "{small}", "--resume", "--set", "name=never"], "cannot resume runs/never: it holds no run"),
    (["run", "{small}", "--resume", "--set", "name=empty"], "cannot resume runs/empty: it holds no run"),
    (["run", "{small}", "--set", "name=taken"], "already holds a run"),
    (["run", "{small}", "--set", "name=taken"], "train(overwrite=true)"),
    (
        ["run", "{small}", "--resume", "--set", "name=bare", "--set", "checkpoint_every=0"],
        "writes no checkpoints",
    ),
    (["run", "--config", "python_task.toml"], "task was given from python"),
    (["run", "--set", "name=a/b"], "name = 'a/b'"),
    (["run", "--set", "checkpoint_every=-1"], "checkpoint_every"),
    (["run", "--set", "rounds=abc"], "must be an integer"),
    (["run", "--resume", "--overwrite"], "not allowed with"),
    # Options follow their owner: options the user gave are checked against the new choice.
    (["run", *_sets("byzantine.attack=sign_flip", "byzantine.options.z=3")], "valid options: ['scale']"),
    (
        ["run", "--config", "user.toml", *_sets("byzantine.attack=sign_flip")],
        "not options of the 'sign_flip'",
    ),
    (["run", "--config", "user.toml", *_sets("byzantine.attack=sign_flip")], "--set 'byzantine.options={}'"),
    (
        ["run", "--preset", "private", *_sets("byzantine.attack=gaussian", "byzantine.options={z = 1.0}")],
        "valid options: ['std']",
    ),
    (["run", *_sets("vote.rule=median", "vote.options={clip_radius = 1.0}")], "median takes no parameter"),
    (["run", *_sets("byzantine.options=3")], "must be a table"),
    (["run", *_sets("byzantine.attack=no_such_attack")], "no_such_attack"),
    (["run", *_sets("weights.objective=no_such_objective")], "no_such_objective"),
    (["run", *_sets("vote.pre_options.clip.max_norm=1")], "vote.pre_options"),
    (["run", *_sets("task.options={no_such_option = 1}")], "no_such_option"),
    # Presets and config files.
    (["run", "--preset", "nope"], "invalid choice: 'nope'"),
    (["run", "--preset", "robust", "--config", "user.toml"], "not allowed with"),
    (["run", "--config", "unknown_preset.toml"], "preset = 'nope' is not valid; choose one of"),
    (["run", "--config", "preset_number.toml"], "must be a string"),
    (["run", "--config", "preset_bad_key.toml"], "no_such_key"),
    (["run", "--config", "a_folder"], "does not exist"),
    (["run", "--config", "missing.toml"], "does not exist"),
    # Files: a merge input that is no checkpoint, given by a relative path.
    (
        ["merge", "--method", "median", "--quiet", "--out", "merged", "a_folder", "runs/empty"],
        "not a checkpoint",
    ),
]


def _ids(cases):
    return [f"{i:02d}-" + " ".join(a for a in c[0] if a != "{small}")[:70] for i, c in enumerate(cases)]


@pytest.fixture
def user_dir(tmp_path, monkeypatch) -> Path:
    _user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_table_has_twenty_cases_or_more():
    assert len(CASES) >= 20


@pytest.mark.parametrize(("argv", "phrase"), CASES, ids=_ids(CASES))
def test_a_mistake_is_one_line_exit_2_and_changes_no_file(user_dir, capsys, argv, phrase):
    argv = [x for a in argv for x in (SMALL_SETS if a == "{small}" else [a])]
    if argv[0] == "run":
        argv = [argv[0], "--quiet", *argv[1:]]
        if not any(a.startswith("name=") for a in argv):
            argv += ["--set", "name=fresh"]
    before = _snapshot(user_dir)
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert phrase.lower() in lines[0].lower(), lines[0]
    assert _snapshot(user_dir) == before


# -- the same from Python ------------------------------------------------------------------------


def _small(tmp_path: Path, *overrides: str) -> config.Config:
    return config.load(
        None, [*SMALL, "rounds=2", "dp.enabled=false", f"output_dir={tmp_path}/runs", *overrides]
    )


class _Crash(RuntimeError):
    pass


def _crashing_round(*args, **kwargs):
    raise _Crash("a bug in the first round")


def test_a_start_that_fails_before_its_first_checkpoint_removes_what_it_created(tmp_path, monkeypatch):
    from meta_consensus import MetaConsensus
    from meta_consensus.coordinator import Coordinator

    monkeypatch.setattr(Coordinator, "round", _crashing_round)
    (tmp_path / "keep.txt").write_text("the user's\n")
    before = _snapshot(tmp_path)
    with pytest.raises(_Crash):
        MetaConsensus(_small(tmp_path, "name=crash"), progress=False).train()
    assert _snapshot(tmp_path) == before  # runs/ and runs/crash were created by the start: both gone
    # A folder the user made is kept, with what it held; only what the start put there goes.
    mine = tmp_path / "runs" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")
    before = _snapshot(tmp_path)
    with pytest.raises(_Crash):
        MetaConsensus(_small(tmp_path, "name=mine"), progress=False).train()
    assert _snapshot(tmp_path) == before


@pytest.mark.slow  # a whole run that fails after its first round (about 6 s)
def test_a_run_without_checkpoints_that_fails_after_a_round_keeps_what_it_logged(tmp_path, monkeypatch):
    from meta_consensus import MetaConsensus
    from meta_consensus.coordinator import Coordinator

    real = Coordinator.round
    calls = {"n": 0}

    def second_round_crashes(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise _Crash("a bug in the second round")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Coordinator, "round", second_round_crashes)
    with pytest.raises(_Crash):
        MetaConsensus(_small(tmp_path, "name=nockpt", "checkpoint_every=0"), progress=False).train()
    metrics = tmp_path / "runs" / "nockpt" / "metrics.jsonl"
    assert len(metrics.read_text().splitlines()) == 1  # the first round's line is kept, not undone


def test_a_task_from_python_is_recorded_by_import_path_or_refused_from_the_config(tmp_path, monkeypatch):
    import sys
    import types

    from meta_consensus import MetaConsensus
    from meta_consensus.run import recorded_config

    cfg = _small(tmp_path, "name=py")
    task = object()
    # No module holds it: marked, and a run from that config alone is refused with one clear line.
    text = recorded_config(cfg, task)
    assert tomllib.loads(text)["task"]["name"] == "<python object: object>"
    (tmp_path / "again.toml").write_text(text)
    again = config.load(tmp_path / "again.toml")  # it still loads (report reads it)
    with pytest.raises(ConfigError, match="task was given from Python"):
        MetaConsensus(again, progress=False)
    # A module holds it: recorded by that import path.
    module = types.ModuleType("my_user_tasks")
    module.TASK = task
    monkeypatch.setitem(sys.modules, "my_user_tasks", module)
    assert tomllib.loads(recorded_config(cfg, task))["task"]["name"] == "my_user_tasks:TASK"
    assert tomllib.loads(recorded_config(cfg, None))["task"]["name"] == "digits"


def test_options_of_the_default_follow_their_owner_with_a_note():
    cfg, notes = config.load_with_notes(None, ["byzantine.attack=sign_flip"])
    assert cfg.byzantine.options == {} and len(notes) == 1
    assert "byzantine.options ['z']" in notes[0] and "dropped" in notes[0]
    cfg, notes = config.load_with_notes(
        None, ["byzantine.attack=sign_flip", "byzantine.options={scale = 3.0}"]
    )
    assert cfg.byzantine.options == {"scale": 3.0} and notes == []
    cfg, notes = config.load_with_notes(None, ["byzantine.attack=alie"])  # the same owner keeps them
    assert cfg.byzantine.options == {"z": 10.0} and notes == []
    cfg, notes = config.load_with_notes(None, ["byzantine.attack=sign_flip"], preset="private")
    assert cfg.name == "private" and cfg.byzantine.options == {} and len(notes) == 1


def test_the_presets_ship_with_the_package_and_configs_point_to_them():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "presets/*.toml" in meta["tool"]["setuptools"]["package-data"]["meta_consensus"]
    assert config.preset_names() == ["lora", "private", "robust", "robust-noserver", "smollm2"]
    assert set(cli._preset_names()) == set(config.preset_names())
    for name in config.preset_names():
        assert config.load(ROOT / "configs" / f"{name}.toml") == config.load(preset=name)
        assert tomllib.loads((ROOT / "configs" / f"{name}.toml").read_text()) == {"preset": name}


@pytest.mark.slow
def test_merge_reads_an_orbax_checkpoint_by_a_relative_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sets = _sets(*SMALL, "rounds=1", "dp.enabled=false", "output_dir=runs")
    for name in ("a", "b"):
        assert cli.main(["run", "--quiet", *sets, "--set", f"name={name}"]) == 0
    capsys.readouterr()
    argv = ["merge", "--method", "median", "--quiet", "--out", "merged", "runs/a", "runs/b/checkpoints"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert any(Path("merged").glob("*.safetensors"))
