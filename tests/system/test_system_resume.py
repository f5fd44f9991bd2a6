"""Interrupted runs resume bit-exactly: SIGKILL, SIGTERM, damaged checkpoints, a mesh and two processes.

Every interrupted run is compared with an uninterrupted one: the consensus, the nodes'
parameters and the privacy ledger must be equal bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from system_helpers import SMALL, small_config

from consensus.privacy import pld_epsilon
from meta_consensus import Coordinator, MetaConsensus, cli, config
from meta_consensus.checkpoint import CheckpointError, RunCheckpoints

ROUNDS = 6
TIMEOUT_S = 300


def _cmd(out, name, *extra, sets=()):
    sets = [*SMALL, f"rounds={ROUNDS}", "checkpoint_every=2", f"output_dir={out}", f"name={name}", *sets]
    args = [sys.executable, "-m", "meta_consensus", "run", "--quiet", *extra]
    for s in sets:
        args += ["--set", s]
    return args


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.getcwd()
    return env


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def _final(out, name, rounds=ROUNDS, template_cfg=None):
    cfg = config.load(out / name / "config.toml")
    ckpt = RunCheckpoints(out / name, cfg)
    assert ckpt.latest() == rounds
    state, history = ckpt.restore(Coordinator(template_cfg or cfg).init(cfg.seed))
    ckpt.close()
    return state, history


def _assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a.consensus), jax.tree.leaves(b.consensus), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a.nodes.params), jax.tree.leaves(b.nodes.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (a.ledger is None) == (b.ledger is None)
    if a.ledger is not None:
        assert a.ledger.epsilon() == b.ledger.epsilon()


def _wait_lines(proc, path, count):
    deadline = time.monotonic() + TIMEOUT_S
    while len(_lines(path)) < count:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"the run did not log {count} rounds"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run (``<dir>/full``), the reference of both signal tests: one run fewer."""
    out = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run(_cmd(out, "full"), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    killed = subprocess.Popen(
        _cmd(tmp_path, "cut"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # Kill after round 3 is logged: the checkpoint of round 2 exists, round 3's work is lost.
        while len(_lines(metrics)) < 3:
            assert killed.poll() is None, killed.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach round 3"
            time.sleep(0.02)
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        logged = len(_lines(metrics))
        assert 3 <= logged < ROUNDS, "the kill should land mid-run"
        resumed = subprocess.run(
            _cmd(tmp_path, "cut", "--resume"), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.communicate()

    a, hist_a = _final(uninterrupted, "full")
    b, hist_b = _final(tmp_path, "cut")
    for x, y in zip(jax.tree.leaves(a.consensus), jax.tree.leaves(b.consensus), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a.nodes.params), jax.tree.leaves(b.nodes.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.ledger.epsilon() == b.ledger.epsilon()
    # the log holds every round exactly once, with the same numbers (timings aside)
    rounds = [json.loads(line) for line in _lines(metrics)]
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    full_rounds = [json.loads(line) for line in _lines(uninterrupted / "full" / "metrics.jsonl")]
    for r, f in zip(rounds, full_rounds, strict=True):
        for timing in ("seconds", "solve_ms"):
            r.pop(timing), f.pop(timing)
        assert r == f
    assert [h.weights for h in hist_a] == [h.weights for h in hist_b]
    # PLD next to the RDP ledger: logged for the checkpointed rounds (every 2nd) and the last, right
    for f in full_rounds:
        r = f["round"] + 1
        if r % 2 == 0 or r == ROUNDS:
            # the run's PLD grid is scaled to the epsilon (coarser than the default 1e-4 here)
            assert f["epsilon_pld"] == pytest.approx(pld_epsilon(0.5, 1.0, r, 1e-5), rel=1e-6)
            assert f["epsilon_pld"] < f["epsilon_rdp"]
        else:
            assert f["epsilon_pld"] == "nan"


@pytest.mark.slow
def test_resume_refuses_a_different_config(tmp_path):
    cfg = config.load(None, [*SMALL, "rounds=1", f"output_dir={tmp_path}", "name=r", "dp.enabled=false"])
    from meta_consensus import MetaConsensus

    MetaConsensus(cfg, progress=False).train()
    other = cfg.replace(vote=cfg.vote.__class__(rule="median"))
    with pytest.raises(ValueError, match="different config.*vote.rule = .multi_krum. in the checkpoint"):
        MetaConsensus(other, progress=False).train(resume=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_saves_the_last_round_and_resume_is_bit_exact(tmp_path, uninterrupted):
    """SIGTERM mid-run: the round in flight finishes, its checkpoint is saved, exit 143; resume ends equal."""
    # checkpoint_every = 5: the checkpoint found after the stop is the one SIGTERM saved
    term_sets = ["checkpoint_every=5"]
    term = subprocess.Popen(
        _cmd(tmp_path, "term", sets=term_sets), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = tmp_path / "term" / "metrics.jsonl"
    try:
        _wait_lines(term, metrics, 2)
        term.send_signal(signal.SIGTERM)
        _, err = term.communicate(timeout=TIMEOUT_S)
        err = err.decode()
        assert term.returncode == 143, err[-3000:]
        assert "SIGTERM" in err and "Traceback" not in err
        logged = len(_lines(metrics))
        assert 2 <= logged < ROUNDS, "the stop should land mid-run"
        steps = sorted(int(p.name) for p in (tmp_path / "term" / "checkpoints").iterdir() if p.name.isdigit())
        assert steps == [logged], "the last finished round is checkpointed"
        resumed = subprocess.run(
            _cmd(tmp_path, "term", "--resume", sets=term_sets),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        if term.poll() is None:
            term.kill()
            term.communicate()
    a, hist_a = _final(uninterrupted, "full")
    b, hist_b = _final(tmp_path, "term")
    _assert_same_state(a, b)
    assert [h.weights for h in hist_a] == [h.weights for h in hist_b]
    assert [h.round for h in hist_b] == list(range(ROUNDS))


def _logged(history):
    """The history's JSON lines without timings."""
    return [{k: v for k, v in h.to_json().items() if k not in ("seconds", "solve_ms")} for h in history]


def _damage(path: Path) -> None:
    """Overwrite every file under ``path`` with bytes that are not what was written (another length)."""
    rng = np.random.default_rng(0)
    for p in sorted(path.rglob("*")):
        if p.is_file():
            p.write_bytes(rng.integers(0, 256, size=p.stat().st_size // 2 + 7, dtype=np.uint8).tobytes())


@pytest.mark.slow
def test_damaged_latest_checkpoints_fall_back_to_the_newest_intact_one(tmp_path, capsys):
    cfg = small_config(tmp_path, "rounds=4")  # a checkpoint every round, 5 kept
    full = MetaConsensus(cfg, progress=False).train()
    ckpts = cfg.run_dir / "checkpoints"
    _damage(ckpts / "4" / "arrays")  # the arrays' files overwritten
    (ckpts / "3" / "meta" / "metadata").write_text('{"round": 3, "fingerp')  # the JSON cut short
    capsys.readouterr()
    resumed = MetaConsensus(cfg, progress=False).train(resume=True)
    err = capsys.readouterr().err
    assert "checkpoint of round 4 is damaged" in err and "checkpoint of round 3 is damaged" in err
    assert "resuming from round 2" in err
    _assert_same_state(full.state, resumed.state)
    assert _logged(resumed.history) == _logged(full.history)
    # the damaged ones were moved aside, not deleted, and the rounds were checkpointed again
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints.damaged").iterdir()) == ["3", "4"]
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [1, 2, 3, 4]


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    cfg = small_config(tmp_path, "rounds=2", "dp.enabled=false")
    MetaConsensus(cfg, progress=False).train()
    ckpts = cfg.run_dir / "checkpoints"
    for step in ("1", "2"):
        _damage(ckpts / step / "arrays")
    listing = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="no intact checkpoint in .*checkpoints"):
        MetaConsensus(cfg, progress=False).train(resume=True)
    capsys.readouterr()
    argv = ["run", "--quiet", "--resume"]
    for s in [*SMALL, "rounds=2", "dp.enabled=false", f"output_dir={tmp_path}", "name=small"]:
        argv += ["--set", s]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(ckpts) in err[0] and "no intact checkpoint" in err[0]
    # nothing was moved when nothing restores
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == listing


# --- meshes -----------------------------------------------------------------------------------

MESH_SETS = [
    *[s for s in SMALL if not s.startswith("nodes.strategies")],
    "nodes.strategies=['hierarchical', 'convexity', 'local', 'hierarchical', 'convexity', 'local']",
    "checkpoint_every=1",
    "mesh.node=2",
]


def _mesh_cmd(out, rounds, *extra):
    args = [sys.executable, "-m", "meta_consensus", "run", "--quiet", *extra]
    for s in [*MESH_SETS, f"rounds={rounds}", f"output_dir={out}", "name=mesh"]:
        args += ["--set", s]
    return args


def _mesh_env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.getcwd()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_all(cmds):
    procs = [
        subprocess.Popen(c, env=_mesh_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


def _mesh_reference(tmp_path, rounds):
    # The same ("node" = 2) mesh on two of this test process's 8 devices.
    cfg = config.load(None, [*MESH_SETS, f"rounds={rounds}", f"output_dir={tmp_path}", "name=reference"])
    return MetaConsensus(cfg, write=False, progress=False).train()


def _assert_mesh_run_equals(tmp_path, reference, rounds):
    cfg = config.load(tmp_path / "mesh" / "config.toml")
    # restored without a mesh on this process: the same values
    state, history = _final(tmp_path, "mesh", rounds, cfg.replace(mesh=cfg.mesh.__class__()))
    _assert_same_state(state, reference.state)
    assert [h.weights for h in history] == [h.weights for h in reference.history]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_on_a_two_device_mesh_is_bit_exact(tmp_path):
    """One process, 2 local devices, mesh.node = 2: 2 rounds, then --resume to 3."""
    _run_all([_mesh_cmd(tmp_path, 2, "--local-devices", "2")])
    _run_all([_mesh_cmd(tmp_path, 3, "--local-devices", "2", "--resume")])
    _assert_mesh_run_equals(tmp_path, _mesh_reference(tmp_path, 3), 3)
