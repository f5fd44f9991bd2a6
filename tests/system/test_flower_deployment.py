"""A real Flower deployment on loopback: flower-superlink, three flower-supernode processes, flwr run.

The package's ServerApp and ClientApp (:mod:`meta_consensus.flower.apps`) run two rounds over
127.0.0.1 (insecure mode: test only, loopback only, free ports). One SuperNode is killed
(SIGKILL of its process group) after it received its round-2 train message: a missing answer,
filed under its partition, and the round goes on with the other two once the SuperLink stops
listing the node (well before the round's timeout). The deployment's consensus must equal, bit for bit,
the same strategy and ClientApp run in this process (:class:`InProcessGrid`) with that node
gone in round 2: the wire (ArrayRecord, ``.npy`` float32) is lossless, the node's state survives
between rounds in Flower's ``context.state``, and the rest is the same computation. (The
in-process :class:`MetaConsensus` comparison, within 1e-5, is in ``test_flower.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flower_helpers import flower_config
from system_helpers import flower_app, flwr_run, loopback_deployment, partitions

from consensus.io import load_safetensors
from meta_consensus import config as config_lib
from meta_consensus.flower import ConsensusStrategy, InProcessGrid, make_client_app

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
NODES = 3
KILLED = 2
ROUND_TIMEOUT = 300.0  # far above the ~20-30 s in which the SuperLink declares the killed node gone


def _config(tmp_path):
    return flower_config(
        tmp_path,
        f"nodes.count={NODES}",
        "nodes.strategies=['hierarchical', 'convexity', 'local']",
        "vote.rule=median",
        "vote.num_byzantine=0",
    )


class _KillAtRound2(InProcessGrid):
    """The in-process twin of the deployment: node KILLED is gone when round 2's training is sent."""

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.group_id == "2" and messages[0].metadata.message_type == "train":
            self.kill(KILLED)
        return super().push_messages(messages)


@pytest.mark.slow
def test_loopback_deployment_with_a_node_killed_mid_round_equals_the_in_process_run(tmp_path):
    cfg = _config(tmp_path / "runs")
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(config_lib.dumps(cfg))
    # blobs_task (the config's task) is a module of tests/system.
    # flower_heartbeat/sitecustomize.py: the SuperNodes' heartbeat at Flower's 10 s minimum, so the
    # SuperLink declares the killed node lost after 20 s instead of 60 s.
    pythonpath = [HERE / "flower_heartbeat", HERE]
    with loopback_deployment(
        tmp_path, flower_app(tmp_path / "app"), partitions(NODES), pythonpath=pythonpath
    ) as dep:
        killed_at = None

        def kill_at_round_2():
            # Kill node KILLED's SuperNode (and its ClientApp process) once round 2's training reached it.
            nonlocal killed_at
            if killed_at is None and dep.log(f"supernode{KILLED}.log").count("Receiving: train message") >= 2:
                os.killpg(dep.nodes[KILLED].pid, signal.SIGKILL)
                killed_at = time.monotonic()

        run_config = f"config='{cfg_file}' evaluate=false round-timeout={ROUND_TIMEOUT} wait-for-nodes=120.0"
        flwr_run(dep, run_config, timeout_s=420, poll=kill_at_round_2)
        assert killed_at is not None, "the SuperNode to kill never received round 2's training"
        # Round 2 went on once the SuperLink stopped listing the killed node: not its timeout.
        after_kill = time.monotonic() - killed_at
        assert after_kill < ROUND_TIMEOUT / 2, after_kill

    run_dir = Path(cfg.run_dir)
    history = [json.loads(line) for line in (run_dir / "flower_rounds.jsonl").read_text().splitlines()]
    assert [h["ok"] for h in history] == [True, True]
    assert history[0]["valid"] == [True] * NODES
    assert history[1]["valid"] == [i != KILLED for i in range(NODES)]
    # Filed under its partition: the SuperLink's "Node Unavailable" reply, or RoundGrid's own
    # "no reply: node went offline" once the SuperLink no longer lists the node.
    why = history[1]["errors"][str(KILLED)]
    assert "Node Unavailable" in why or "no reply: node went offline" in why, history[1]["errors"]
    assert set(history[1]["errors"]) == {str(KILLED)}
    twin = ConsensusStrategy(cfg, evaluate=False, wait_for_nodes_s=0.0)
    twin.start(
        _KillAtRound2(make_client_app(), NODES), twin.initial_arrays(), num_rounds=cfg.rounds, timeout=60
    )
    for mine, theirs in zip(twin.history, history, strict=True):
        assert mine.accepted == theirs["accepted"] and mine.weights == theirs["weights"]
        assert mine.epsilon == theirs["epsilon"]
    # Checked against the twin's keys, shapes and dtypes, then compared bit for bit.
    deployed = load_safetensors(run_dir / "consensus.safetensors", like=twin.consensus)
    for got, want in zip(jax.tree.leaves(deployed), jax.tree.leaves(twin.consensus), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
