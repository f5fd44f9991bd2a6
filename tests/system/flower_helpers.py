"""Shared settings of the Flower tests: a small blobs config every Flower path can run."""

from __future__ import annotations

from meta_consensus import config

# 5 nodes with every strategy, multi-Krum (f = 1) -> mixture weights -> DP; no simulated attacks
# or faults (on Flower those are real clients and real failures).
FLOWER_SMALL = [
    "rounds=2",
    "seed=5",
    "checkpoint_every=0",
    "max_retries=0",
    "baseline_fedavg=false",
    "task.name=blobs_task:make_task",
    "task.alpha=5.0",
    "nodes.count=5",
    "nodes.strategies=['hierarchical', 'convexity', 'soup', 'local', 'local']",
    "nodes.local_steps=6",
    "nodes.learning_rate=0.03",
    "nodes.options.soup.snapshots=2",
    "byzantine.nodes=[]",
    "faults.drop_rate=0.0",
    "vote.rule=multi_krum",
    "vote.num_byzantine=1",
    "weights.objective=mixture_nll",
    "weights.max_weight=0.5",
    "dp.enabled=true",
    "dp.clip_norm=1.0",
    "dp.noise_multiplier=0.8",
]


def flower_config(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*FLOWER_SMALL, f"output_dir={tmp_path}", "name=flower", *overrides])


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A Flower app (FAB) that names the package's ServerApp and ClientApp; `flwr run` builds it.
APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "meta-consensus-flower-test"
version = "0.1.0"
dependencies = []

[tool.flwr.app]
publisher = "meta-consensus"

[tool.flwr.app.components]
serverapp = "meta_consensus.flower.apps:server_app"
clientapp = "meta_consensus.flower.apps:client_app"

[tool.flwr.app.config]
config = ""
overrides = ""
round-timeout = 600.0
evaluate = true
wait-for-nodes = 120.0
"""
