"""Two processes under ``jax.distributed`` (loopback, gloo) run the system and match one process.

Each process hosts one CPU device and half of the nodes (its data only); the
nodes' mesh axis spans both processes. The single-process reference runs the
same mesh shape on two devices of the test process, so the programs are the
same and the consensus must agree exactly. Only process 0 writes logs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from system_helpers import SMALL

from meta_consensus import Coordinator, MetaConsensus, config
from meta_consensus.checkpoint import RunCheckpoints

TIMEOUT_S = 300
SETS = [
    *[s for s in SMALL if not s.startswith("nodes.strategies")],
    "nodes.strategies=['hierarchical', 'convexity', 'local', 'hierarchical', 'convexity', 'local']",
    "rounds=2",
    "checkpoint_every=1",
    "mesh.node=2",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmd(out, name, *extra):
    args = [sys.executable, "-m", "meta_consensus", "run", "--quiet", *extra]
    for s in [*SETS, f"output_dir={out}", f"name={name}"]:
        args += ["--set", s]
    return args


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.getcwd()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _wait(procs):
    deadline = time.monotonic() + TIMEOUT_S
    outs = {}
    try:
        for name, p in procs.items():
            try:
                outs[name] = p.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
            except subprocess.TimeoutExpired:
                p.kill()
                pytest.fail(f"{name} did not finish in {TIMEOUT_S}s:\n{p.communicate()[0][-3000:]}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{outs[name][-4000:]}"
    return outs


def _final(run_dir):
    cfg = config.load(run_dir / "config.toml")
    ckpt = RunCheckpoints(run_dir, cfg)
    # The reference restores on this (8-device) test process without a mesh: same values.
    state, history = ckpt.restore(Coordinator(cfg.replace(mesh=cfg.mesh.__class__())).init(cfg.seed))
    ckpt.close()
    return state, history


def _two_processes(out, *extra):
    port = _free_port()
    dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--local-devices", "1"]
    procs = {
        f"process {i}": subprocess.Popen(
            _cmd(out, "multi", *dist, "--process-id", str(i), *extra),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    }
    return _wait(procs)


def _assert_equal(multi, hist_m, single):
    for a, b in zip(jax.tree.leaves(multi.consensus), jax.tree.leaves(single.consensus_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nodes = jax.tree.leaves(single.state.nodes.params)
    for a, b in zip(jax.tree.leaves(multi.nodes.params), nodes, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [h.weights for h in hist_m] == [h.weights for h in single.history]
    assert [h.node_accuracy for h in hist_m] == [h.node_accuracy for h in single.history]


# Two minutes of make test's wall time on 2 cores (two jax.distributed processes, twice): in the slow
# tier, which CI runs after make test, like the other two-process tests (tests/strategies/test_multihost.py).
@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_equal_one_and_resume_bit_exact(tmp_path):
    """2 rounds on two processes == one process; then both --resume from round 1's checkpoint == again.

    (One test for both, so the processes and the reference start once: each start imports jax and
    compiles the round on a 2-core machine.)
    """
    outs = _two_processes(tmp_path)
    # only process 0 logs (gloo's own connection line aside)
    assert "meta-consensus" in outs["process 0"] and "meta-consensus" not in outs["process 1"]
    multi, hist_m = _final(tmp_path / "multi")
    # The single-process reference: the same ("node" = 2) mesh on two of this process's devices.
    cfg = config.load(None, [*SETS, f"output_dir={tmp_path}", "name=single"])
    single = MetaConsensus(cfg, write=False, progress=False).train()
    _assert_equal(multi, hist_m, single)

    # Resume: round 2's checkpoint moved out of the run (as if the run had died before writing
    # it), both processes restore round 1's (written by two processes) and run round 2 again.
    ckpts = tmp_path / "multi" / "checkpoints"
    (ckpts / "2").rename(tmp_path / "round2.moved")
    round1 = {p: p.stat().st_mtime_ns for p in (ckpts / "1").rglob("*") if p.is_file()}
    _two_processes(tmp_path, "--resume")
    # Restored, not recomputed: round 1's checkpoint is untouched, round 2's written again.
    assert {p: p.stat().st_mtime_ns for p in (ckpts / "1").rglob("*") if p.is_file()} == round1
    assert (ckpts / "2").is_dir()
    resumed, hist_r = _final(tmp_path / "multi")
    _assert_equal(resumed, hist_r, single)
