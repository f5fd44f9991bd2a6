"""Bad invocations of ``meta-consensus run`` and ``report``: one line on stderr, exit 2, no file changed.

Each case runs the command's ``main`` in this process (the same code path as the
console script, without a second jax start-up) and snapshots the output directory
before and after; one case runs the real ``python -m meta_consensus`` in a
subprocess to check the entry point end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from system_helpers import SMALL, sets, snapshot

from meta_consensus import cli


def _invoke(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished one-round run ``<out>/done`` (no DP: the cheapest complete run)."""
    out = tmp_path_factory.mktemp("runs")
    flags = sets(*SMALL, "rounds=1", "dp.enabled=false", f"output_dir={out}", "name=done")
    assert cli.main(["run", "--quiet", *flags]) == 0
    assert (out / "done" / "checkpoints" / "1").is_dir()
    return out


def _bad_files(root: Path) -> None:
    (root / "bad.toml").write_text("rounds = = 3\n")
    bad_cfg = root / "bad_config_run"
    bad_cfg.mkdir()
    (bad_cfg / "config.toml").write_text("no_such_key = 1\n")
    (bad_cfg / "metrics.jsonl").write_text("")
    bad_log = root / "bad_metrics_run"
    bad_log.mkdir()
    (bad_log / "config.toml").write_text("rounds = 2\n")
    (bad_log / "metrics.jsonl").write_text('{"round": 0, "ok": tru\n')


# (argv with {out} for the output directory, a phrase the one line must contain)
CASES = [
    (["run", "--no-such-flag"], "unrecognized arguments"),
    (["run", "--set", "rounds=3", "--resume", "--overwrite"], "not allowed with"),
    (["run", "--set", "no_such_key=1"], "no_such_key"),
    (["run", "--set", "rounds=-1"], "rounds"),
    (["run", "--set", "vote.rule=no_such_rule"], "no_such_rule"),
    (["run", "--config", "{out}/missing.toml"], "does not exist"),
    (["run", "--config", "{out}/bad.toml"], "not valid TOML"),
    (["run", "--num-processes", "2"], "--coordinator"),
    (["run", "--process-id", "3"], "--process-id"),
    (["run", "--local-devices", "0"], "--local-devices"),
    # Values the default Multi-Krum vote cannot run with: 4 nodes with the default strategies
    # and attackers, and (isolated) 4 nodes with f = 1, where Multi-Krum needs n > 2f + 2.
    (["run", "--set", "nodes.count=4"], "nodes"),
    (
        ["run", *sets("nodes.count=4", "nodes.strategies=local", "byzantine.nodes=[3]")]
        + sets("vote.num_byzantine=1"),
        "multi",
    ),
    (["report"], "run_dir"),
    (["report", "{out}/no_such_run"], "not found"),
    (["report", "{out}/bad_config_run"], "no_such_key"),
    (["report", "{out}/bad_metrics_run"], "metrics"),
]


# The same against a finished run in the output directory.
CASES_WITH_A_RUN = [
    (["run", "--set", "name=done"], "already holds a run"),
    (["run", "--resume", "--set", "name=done", "--set", "vote.rule=median"], "different config"),
]


def _ids(cases):
    return [" ".join(c[0])[:60] for c in cases]


@pytest.mark.parametrize(("argv", "phrase"), CASES, ids=_ids(CASES))
def test_bad_invocation_is_one_line_exit_2_and_changes_nothing(tmp_path, capsys, argv, phrase):
    _bad_files(tmp_path)
    _check_bad_invocation(tmp_path, capsys, argv, phrase)


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "phrase"), CASES_WITH_A_RUN, ids=_ids(CASES_WITH_A_RUN))
def test_bad_invocation_against_a_finished_run(finished_run, capsys, argv, phrase):
    _check_bad_invocation(finished_run, capsys, argv, phrase)


def _check_bad_invocation(out: Path, capsys, argv: list[str], phrase: str) -> None:
    argv = [a.replace("{out}", str(out)) for a in argv]
    if argv[0] == "run" and len(argv) > 1:
        # the finished run's small settings, so that only the case's own change is wrong
        base = [] if "--config" in argv else sets(*SMALL, "rounds=1", "dp.enabled=false")
        argv = [*argv[:1], "--quiet", *base, "--set", f"output_dir={out}", *argv[1:]]
        if not any(a.startswith("name=") for a in argv):
            argv += ["--set", "name=fresh"]
    before = snapshot(out)
    rc, err = _invoke(argv, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert phrase.lower() in lines[0].lower(), lines[0]
    assert snapshot(out) == before


@pytest.mark.slow
def test_overwrite_moves_the_earlier_run_aside(capsys, tmp_path):
    out = tmp_path
    first = out / "x"
    argv = ["run", "--quiet", *sets(*SMALL, "rounds=1", "dp.enabled=false", f"output_dir={out}", "name=x")]
    assert cli.main(argv) == 0
    earlier = snapshot(first)
    assert cli.main([*argv, "--overwrite"]) == 0
    assert "moved the earlier run" in capsys.readouterr().err
    # the earlier run is intact under its new name, and a new complete run is in its place
    assert snapshot(out / "x.old-1") == earlier
    assert (first / "checkpoints" / "1").is_dir()
    assert len((first / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_entry_point_refuses_an_existing_run(finished_run):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.getcwd()
    before = snapshot(finished_run)
    argv = [sys.executable, "-m", "meta_consensus", "run", "--quiet"]
    argv += sets(*SMALL, "rounds=1", "dp.enabled=false", f"output_dir={finished_run}", "name=done")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "already holds a run" in proc.stderr and "--resume" in proc.stderr
    assert snapshot(finished_run) == before


@pytest.mark.slow
@pytest.mark.multiprocess
def test_importing_the_package_leaves_the_device_count_to_the_cli():
    """No jax computation at import: --local-devices and jax.distributed must come first."""
    code = (
        "import os, meta_consensus.cli, meta_consensus, consensus, strategies\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=3'\n"
        "import jax\n"
        "assert jax.device_count() == 3, jax.devices()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.getcwd()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_run_in_which_no_round_succeeded_exits_1(tmp_path, capsys):
    # every node crashes: each round fails with too few valid answers, and is skipped
    crash = "faults.crash_nodes=[0, 1, 2, 3, 4, 5]"
    flags = sets(*SMALL, "rounds=2", "max_retries=0", "dp.enabled=false", crash)
    rc = cli.main(["run", "--quiet", *flags, "--set", f"output_dir={tmp_path}", "--set", "name=failed"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "no round succeeded (2 attempts" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("META_CONSENSUS_CPU_VECTOR_WIDTH", "99", "must be one of 256, 512, xla"),
        ("META_CONSENSUS_KERNEL_THREADS", "0", "META_CONSENSUS_KERNEL_THREADS must be a positive integer"),
    ],
)
def test_a_bad_kernel_setting_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    rc, err = _invoke(["run", "--quiet", *sets(*SMALL, f"output_dir={tmp_path}")], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and message in err
    assert snapshot(tmp_path) == {}
