"""A run killed with SIGKILL and resumed ends with exactly the consensus of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from system_helpers import SMALL

from meta_consensus import Coordinator, config
from meta_consensus.checkpoint import RunCheckpoints

ROUNDS = 6
TIMEOUT_S = 300


def _cmd(out, name, *extra):
    sets = [*SMALL, f"rounds={ROUNDS}", "checkpoint_every=2", f"output_dir={out}", f"name={name}"]
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


def _final(out, name):
    cfg = config.load(out / name / "config.toml")
    ckpt = RunCheckpoints(out / name, cfg)
    assert ckpt.latest() == ROUNDS
    state, history = ckpt.restore(Coordinator(cfg).init(cfg.seed))
    ckpt.close()
    return state, history


@pytest.mark.multiprocess
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    full = subprocess.Popen(
        _cmd(tmp_path, "full"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
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
        out, _ = full.communicate(timeout=TIMEOUT_S)
        assert full.returncode == 0, out.decode()[-3000:]
    finally:
        for p in (full, killed):
            if p.poll() is None:
                p.kill()
                p.communicate()

    a, hist_a = _final(tmp_path, "full")
    b, hist_b = _final(tmp_path, "cut")
    for x, y in zip(jax.tree.leaves(a.consensus), jax.tree.leaves(b.consensus), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a.nodes.params), jax.tree.leaves(b.nodes.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.ledger.epsilon() == b.ledger.epsilon()
    # the log holds every round exactly once, with the same numbers (timings aside)
    rounds = [json.loads(line) for line in _lines(metrics)]
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    full_rounds = [json.loads(line) for line in _lines(tmp_path / "full" / "metrics.jsonl")]
    for r, f in zip(rounds, full_rounds, strict=True):
        for timing in ("seconds", "solve_ms"):
            r.pop(timing), f.pop(timing)
        assert r == f
    assert [h.weights for h in hist_a] == [h.weights for h in hist_b]


def test_resume_refuses_a_different_config(tmp_path):
    cfg = config.load(None, [*SMALL, "rounds=1", f"output_dir={tmp_path}", "name=r", "dp.enabled=false"])
    from meta_consensus import MetaConsensus

    MetaConsensus(cfg, progress=False).train()
    other = cfg.replace(vote=cfg.vote.__class__(rule="median"))
    with pytest.raises(ValueError, match="different config"):
        MetaConsensus(other, progress=False).train(resume=True)
