"""A LoRA run on a real Flower deployment on loopback: the arrays on the wire are the adapters'.

flower-superlink, two flower-supernode processes and ``flwr run`` of the package's ServerApp and
ClientApp (insecure mode, 127.0.0.1 only, free ports), two rounds of FLoRA's stacking on the text
task. The strategy counts the arrays of every message it sends and receives over gRPC
(``flower_rounds.jsonl``: ``bytes_down``, ``bytes_up``, per node); they must be the adapter's bytes
computed here from the model's shapes (2 layers x 5 targets at rank 4), with the dense base delta
added to the second round's messages (stack folds each merge into the base), and far below the
model's. The consensus the ServerApp writes holds the adapter's arrays only, and equals the same
strategy and ClientApp run in this process (:class:`InProcessGrid`) bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from system_helpers import flower_app, flwr_run, loopback_deployment, partitions

from consensus.io import load_safetensors
from meta_consensus import config as config_lib
from meta_consensus.flower import ConsensusStrategy, InProcessGrid, make_client_app

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
PRESET = HERE.parents[1] / "configs" / "lora.toml"
NODES = 2
D, MLP, LAYERS, RANK = 32, 64, 2, 4


def _config(tmp_path):
    return config_lib.load(
        PRESET,
        [
            "rounds=2",
            "checkpoint_every=0",
            "max_retries=0",
            "task.options={context = 16, d_model = 32, d_mlp = 64, windows_per_node = 32, "
            "general_windows = 64, heldout_windows = 16, test_windows = 16}",
            f"nodes.count={NODES}",
            "nodes.strategies='local'",
            "nodes.local_steps=3",
            "nodes.batch_size=4",
            "nodes.lora.pretrain_steps=3",
            "byzantine.nodes=[]",
            "vote.rule=mean",
            "vote.num_byzantine=0",
            "vote.adapter_method=stack",
            f"output_dir={tmp_path}",
            "name=lora_flower",
        ],
    )


@pytest.mark.slow
def test_loopback_deployment_carries_the_adapters_only(tmp_path):
    cfg = _config(tmp_path / "runs")
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(config_lib.dumps(cfg))
    with loopback_deployment(tmp_path, flower_app(tmp_path / "app"), partitions(NODES)) as dep:
        flwr_run(
            dep, f"config='{cfg_file}' evaluate=false round-timeout=600.0 wait-for-nodes=120.0", timeout_s=900
        )

    run_dir = Path(cfg.run_dir)
    history = [json.loads(line) for line in (run_dir / "flower_rounds.jsonl").read_text().splitlines()]
    assert [h["ok"] for h in history] == [True, True], [h["errors"] for h in history]
    # float32 adapters: per layer, 3 attention kernels (D x D) and the MLP's D x MLP and MLP x D.
    adapter = 4 * LAYERS * (3 * RANK * (D + D) + 2 * RANK * (D + MLP))
    delta = 4 * LAYERS * (3 * D * D + 2 * D * MLP)
    model_floats = _model_floats(cfg)
    assert [h["bytes_up"] for h in history] == [adapter, adapter]
    assert [h["bytes_down"] for h in history] == [adapter, adapter + delta]
    assert adapter < 4 * model_floats / 5
    twin = ConsensusStrategy(cfg, evaluate=False, wait_for_nodes_s=0.0)
    twin.start(
        InProcessGrid(make_client_app(), NODES), twin.initial_arrays(), num_rounds=cfg.rounds, timeout=600
    )
    deployed = load_safetensors(run_dir / "consensus.safetensors", like=twin.consensus)
    assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(deployed)) == adapter
    for got, want in zip(jax.tree.leaves(deployed), jax.tree.leaves(twin.consensus), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def _model_floats(cfg) -> int:
    """Scalars of the base model (from its init's shapes)."""
    from meta_consensus.fleet import make_task

    task = make_task(cfg)
    shapes = jax.eval_shape(task.init, jax.random.key(0))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
