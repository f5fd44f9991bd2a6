"""Buffered asynchronous rounds on a real Flower deployment (loopback): a slow SuperNode holds no merge up.

A SuperLink and three SuperNodes on 127.0.0.1 (insecure: test only, free ports) run the package's
ServerApp with ``[schedule] mode = "async"`` and a buffer of 2. SuperNode 2 runs the package's
ClientApp after a 600 s pause (``slow_client.py``, ``delay-s`` in its node config), far longer
than the test: every buffer must be applied from the other two nodes, with staleness from the
strategy's own record, and the run must end long before the slow node could answer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from flower_helpers import APP_PYPROJECT, flower_config
from system_helpers import flwr_run, loopback_deployment

from meta_consensus import config as config_lib

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
NODES = 3
SLOW = 2
DELAY_S = 600.0
BUFFERS = 3


@pytest.mark.slow
def test_a_slow_supernode_holds_no_buffer_up(tmp_path):
    cfg = flower_config(
        tmp_path / "runs",
        f"nodes.count={NODES}",
        "nodes.strategies=local",
        "vote.rule=median",
        "vote.num_byzantine=0",
        "weights.objective=vote",
        "dp.enabled=false",
        "schedule.mode=async",
        "schedule.buffer=2",
        f"rounds={BUFFERS}",
    )
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(config_lib.dumps(cfg))
    app = tmp_path / "app"
    app.mkdir()
    pyproject = APP_PYPROJECT.replace('"meta_consensus.flower.apps:client_app"', '"slow_client:client_app"')
    assert "slow_client:client_app" in pyproject
    (app / "pyproject.toml").write_text(pyproject)
    node_configs = [
        f"partition-id={i} num-partitions={NODES}" + (f" delay-s={DELAY_S}" if i == SLOW else "")
        for i in range(NODES)
    ]
    with loopback_deployment(tmp_path, app, node_configs, pythonpath=[HERE]) as dep:
        start = time.monotonic()
        run_config = f"config='{cfg_file}' evaluate=false round-timeout=900.0 wait-for-nodes=120.0"
        flwr_run(dep, run_config, timeout_s=DELAY_S / 2)
        took = time.monotonic() - start
        # The slow node was asked (it received a train message) and is still sleeping on it.
        assert dep.log(f"supernode{SLOW}.log").count("Receiving: train message") >= 1
    assert took < DELAY_S / 2
    history = [
        json.loads(line) for line in (Path(cfg.run_dir) / "flower_rounds.jsonl").read_text().splitlines()
    ]
    assert len(history) == BUFFERS and all(h["ok"] for h in history)
    for h in history:
        assert sorted(h["buffer"]) == [0, 1]  # merges went on without the slow node
        assert h["answered"][SLOW] is False and h["weights"][SLOW] == 0.0
        assert h["staleness"] == [h["server_round"] - 1 - v for v in h["versions"]]
    assert (Path(cfg.run_dir) / "consensus.safetensors").exists()
