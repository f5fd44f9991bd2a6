"""Flower's simulation engine (Ray, one machine) running the package's ServerApp and ClientApp.

The path installed flwr documents for simulations: a SuperLink in simulation mode
(``flower-superlink --simulation``) and ``flwr run APP local --federation-config
"num-supernodes=3 ..."``; the SuperLink starts ``flwr-simulation``, which runs the ServerApp
and puts the 3 virtual SuperNodes' ClientApps on Ray actors. (``flwr.simulation.run_simulation``,
the in-Python form, is deprecated in flwr 1.41.) Ray is limited to 2 CPUs and one CPU per
ClientApp, so at most two nodes train at once on a 2-core machine.

The run's consensus must equal, bit for bit, the same ConsensusStrategy and ClientApp run in
this process on :class:`InProcessGrid` (as in ``test_flower_deployment.py``): the arrays cross
process boundaries as lossless ``.npy`` float32, each node's state survives between rounds in
Flower's ``context.state``, and the rest is the same computation. Every process the test started
(SuperLink, flwr-simulation, Ray's GCS, raylet and workers) is killed at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest
from flower_helpers import APP_PYPROJECT, flower_config, free_port

from consensus.io import load_safetensors
from meta_consensus import config as config_lib
from meta_consensus.flower import ConsensusStrategy, InProcessGrid, make_client_app

# Flower's simulation engine is its own extra (Ray is heavy); .ci/run installs it, `make test` on a
# venv with the dev extra alone skips this file.
# Looked up, not imported: importing Ray at collection costs every worker seconds, even when this
# file's tests are deselected.
if importlib.util.find_spec("ray") is None:
    pytest.skip(
        'Flower\'s simulation engine is not installed: pip install -e ".[flower-simulation]"',
        allow_module_level=True,
    )

pytestmark = pytest.mark.multiprocess

BIN = Path(sys.executable).parent
NODES = 3
TIME_LIMIT_S = 560  # Ray, jax and XLA start in every actor: minutes on a loaded 2-core machine


def _kill_tree(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process started here and all their descendants (Ray's included)."""
    victims: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(p.pid)
            victims += [root, *root.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # each was started in a session of its own
    for v in victims:  # descendants that left the process group (setsid) too
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    psutil.wait_procs(victims, timeout=30)
    for p in procs:
        p.wait(timeout=30)
        p.log.close()


@pytest.mark.slow
def test_simulation_engine_runs_the_package_apps_and_equals_the_in_process_run(tmp_path):
    cfg = flower_config(
        tmp_path / "runs",
        f"nodes.count={NODES}",
        "nodes.strategies=['hierarchical', 'convexity', 'local']",
        "vote.rule=median",
        "vote.num_byzantine=0",
    )
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(config_lib.dumps(cfg))
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(APP_PYPROJECT)
    home = tmp_path / "flwr_home"
    home.mkdir()
    link = free_port()
    # flwr's own config (FLWR_HOME): the SuperLink connection "local", insecure, on loopback.
    connection = f'address = "127.0.0.1:{link}"\ninsecure = true\n'
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n{connection}')
    ray_tmp = tempfile.mkdtemp(prefix="mc-ray-", dir="/tmp")
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        # blobs_task (the config's task) is a module of tests/system; Ray's workers inherit this.
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
        JAX_PLATFORMS="cpu",
        # Ray's session files in a folder of this test (short: its socket paths must fit in 107 bytes).
        RAY_TMPDIR=ray_tmp,
        RAY_USAGE_STATS_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
    )
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: Path) -> subprocess.Popen:
        fh = open(log, "w")  # noqa: SIM115 - closed with the process in _kill_tree
        p = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        p.log = fh
        procs.append(p)
        return p

    try:
        superlink = start(
            [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1"]
            + ["--port", str(link), "--control-api-address", f"127.0.0.1:{free_port()}"],
            tmp_path / "superlink.log",
        )
        run_config = f"config='{cfg_file}' evaluate=false round-timeout=400.0 wait-for-nodes=60.0"
        federation = f"num-supernodes={NODES} init-args-num-cpus=2 client-resources-num-cpus=1"
        run = start(
            [str(BIN / "flwr"), "run", str(app), "local", "--stream"]
            + ["--run-config", run_config, "--federation-config", federation],
            tmp_path / "flwr_run.log",
        )
        history_file = Path(cfg.run_dir) / "flower_rounds.jsonl"
        deadline = time.monotonic() + TIME_LIMIT_S
        # flwr run streams the logs and exits with the run; the ServerApp writes the history last.
        while run.poll() is None and time.monotonic() < deadline:
            assert superlink.poll() is None, (tmp_path / "superlink.log").read_text()[-3000:]
            time.sleep(0.5)
        logs = (tmp_path / "flwr_run.log").read_text(errors="replace")[-3000:]
        assert run.poll() is not None, "flwr run did not finish in time: " + logs
        assert run.returncode == 0, logs
        # flwr run exits 0 even when the simulation crashed: the history file is the ServerApp's word.
        assert history_file.exists(), "the ServerApp wrote no round history: " + logs
    finally:
        _kill_tree(procs)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not [p for p in procs if p.poll() is None]

    history = [json.loads(line) for line in history_file.read_text().splitlines()]
    assert [h["ok"] for h in history] == [True] * cfg.rounds
    assert all(h["valid"] == [True] * NODES for h in history)
    twin = ConsensusStrategy(cfg, evaluate=False, wait_for_nodes_s=0.0)
    twin.start(
        InProcessGrid(make_client_app(), NODES), twin.initial_arrays(), num_rounds=cfg.rounds, timeout=60
    )
    for mine, theirs in zip(twin.history, history, strict=True):
        assert mine.accepted == theirs["accepted"] and mine.weights == theirs["weights"]
        assert mine.epsilon == theirs["epsilon"]
    simulated = load_safetensors(Path(cfg.run_dir) / "consensus.safetensors", like=twin.consensus)
    for got, want in zip(jax.tree.leaves(simulated), jax.tree.leaves(twin.consensus), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
