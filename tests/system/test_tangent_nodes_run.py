"""Tangent nodes in the system (``nodes.options.convexity = {mode = "tangent"}``).

The config refuses them with LoRA and example-level DP, naming the key; a run with them trains
and merges (the trainer's side, against the linearised task itself:
tests/strategies/test_tangent_nodes.py).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from system_helpers import SMALL

from meta_consensus import config
from meta_consensus.coordinator import Coordinator

TANGENT = ["nodes.strategies=convexity", "nodes.options.convexity={mode = 'tangent'}"]
BASE = [*SMALL, "rounds=1", "nodes.count=4", "byzantine.nodes=[]", "vote.rule=mean",
        "vote.num_byzantine=0", "weights.objective=uniform", "dp.enabled=false", "baseline_fedavg=false",
        "vote.server_step=0"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["nodes.lora={rank = 2}", "nodes.lora.targets=['dense_0']"], "not with [nodes.lora]"),
        (["dp.enabled=true", "dp.level=example", "dp.noise_multiplier=1.0"], "dp.level = 'example'"),
    ],
)
def test_the_config_refuses_tangent_nodes_with_lora_or_example_dp(tmp_path, extra, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load(None, [*BASE, f"output_dir={tmp_path}", *TANGENT, *extra])


def test_a_run_with_tangent_nodes_trains_and_merges(tmp_path):
    cfg = config.load(None, [*BASE, f"output_dir={tmp_path}", *TANGENT, "nodes.public_warm_start=0"])
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert info.ok, info
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
             zip(jax.tree.leaves(new.consensus), jax.tree.leaves(state.consensus), strict=True)]  # fmt: skip
    assert max(moved) > 0 and all(np.isfinite(m) for m in moved)
