"""Bring your own task: a model and arrays defined outside the package run through the CLI and the API."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from blobs_task import blobs, make_task

from meta_consensus import MetaConsensus, cli, config
from meta_consensus.config import ConfigError
from strategies.registry import RegistryError, resolve_task
from strategies.tasks import task_from_arrays

SMALL = [
    "rounds=2",
    "nodes.count=4",
    "nodes.strategies=local",
    "nodes.local_steps=10",
    "nodes.learning_rate=0.03",
    "byzantine.nodes=[]",
    "vote.rule=median",
    "weights.objective=uniform",
    "dp.enabled=false",
    "baseline_fedavg=false",
    "task.alpha=5.0",
]


def test_task_from_arrays_splits_and_metrics_match_numpy():
    task = make_task()
    data = task.splits(4, seed=1, alpha=5.0)
    train, held, test = task.split_rows
    # The three splits partition the rows, stratified: each class keeps ~its share in each split.
    assert len(np.intersect1d(train, held)) == len(np.intersect1d(train, test)) == 0
    assert len(train) + len(held) + len(test) == len(task.y)
    # The public pool (a stratified tenth of the training split) and the node shards partition it.
    public = data.meta["general_ids"]
    assert np.isin(public, train).all() and abs(len(public) - 0.1 * len(train)) <= task.num_classes
    shards = data.meta["example_ids"][data.meta["example_ids"] >= 0]
    assert np.intersect1d(shards, public).size == 0
    assert int(data.train_count.sum()) + len(public) == len(train)
    params = task.init(jax.random.key(0))
    batch = {"x": data.test["x"], "y": data.test["y"]}
    got = {k: float(v) for k, v in task.metrics(params, batch).items()}
    logits = np.asarray(task.apply(params, batch["x"]), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    want_loss = -logp[np.arange(len(batch["y"])), batch["y"]].mean()
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
    assert got["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == batch["y"]))


@pytest.mark.slow
def test_cli_runs_a_task_given_by_import_path(tmp_path, capsys):
    overrides = [*SMALL, f"output_dir={tmp_path}", "name=blobs", "task.name=blobs_task:make_task"]
    code = cli.main(
        ["run", "--quiet", *sum((["--set", o] for o in overrides), []), "--set", "task.options.width=8"]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "blobs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["ok"] for r in rows)
    # Well-separated blobs: the consensus of 4 nodes learns them in two rounds of 10 steps.
    assert rows[-1]["consensus_accuracy"] > 0.8


@pytest.mark.slow
def test_python_api_takes_a_task_object(tmp_path):
    cfg = config.load(None, [*SMALL, f"output_dir={tmp_path}", "name=api"])
    result = MetaConsensus(cfg, task=make_task(width=8), write=False, progress=False).train()
    assert result.history[-1].ok and result.history[-1].consensus_accuracy > 0.8


def test_bad_task_paths_and_objects_name_what_is_missing():
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module'"):
        resolve_task("no_such_module:make")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        resolve_task("blobs_task:nope")
    with pytest.raises(TypeError, match="is not a Task: it has no name .*init, apply, loss"):
        resolve_task("blobs_task:not_a_task")
    with pytest.raises(ConfigError, match=r"task.options \['width'\] are not options of the 'digits' task"):
        config.load(None, ["task.options.width=3"])  # a registered task's options are checked at load


def test_task_from_arrays_rejects_bad_arrays():
    x, y = blobs(40)
    with pytest.raises(ValueError, match="x must be"):
        task_from_arrays(lambda r: None, x[:, 0], y)
    with pytest.raises(ValueError, match="non-negative integer"):
        task_from_arrays(lambda r: None, x, y.astype(np.float32))
    with pytest.raises(ValueError, match="both heldout and test"):
        task_from_arrays(lambda r: None, x, y, heldout=(x, y))
