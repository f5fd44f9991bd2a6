"""Digits task: splits, partition, model against a float64 numpy reference, and a trained accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from strategies.tasks import base
from strategies.tasks.digits import DigitsTask
from strategies.trainer import NodeTrainer

TASK = DigitsTask(hidden=(16,))


def _np_forward(params, x):
    """float64 numpy forward pass of the MLP."""
    h = np.asarray(x, np.float64)
    layers = sorted(params, key=lambda k: int(k.split("_")[1]))
    for i, name in enumerate(layers):
        h = h @ np.asarray(params[name]["kernel"], np.float64) + np.asarray(params[name]["bias"], np.float64)
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    return h


def _np_xent(logits, y):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(y)), y]


def test_splits_partition_the_training_split():
    d = TASK.splits(5, seed=3, alpha=0.3)
    assert d.train["x"].shape[0] == 5 and d.train["x"].shape[2] == 64
    ids = d.meta["example_ids"]
    shards = [ids[i, : d.train_count[i]] for i in range(5)]
    all_ids = np.concatenate(shards)
    assert len(all_ids) == len(np.unique(all_ids)), "node shards overlap"
    # The general pool is the public split: disjoint from every shard, and with them the training split.
    public = d.meta["general_ids"]
    assert d.general_pool == "public" and np.intersect1d(public, all_ids).size == 0
    assert len(all_ids) + len(public) == 1797 - 360 - 180, "shards and public pool do not cover training"
    # Stratified: every class has round(0.1 * its training rows) public rows.
    from sklearn.datasets import load_digits

    labels = load_digits().target
    per_class = np.bincount(labels[np.concatenate([all_ids, public])], minlength=10)
    np.testing.assert_array_equal(
        np.bincount(labels[public], minlength=10), np.round(0.1 * per_class).astype(int)
    )
    np.testing.assert_array_equal(d.general["y"], labels[public])
    # Padding is marked.
    for i in range(5):
        assert np.all(ids[i, d.train_count[i] :] == -1)
        assert np.all(d.train_groups[i, d.train_count[i] :] == -1)
    # The rows of each shard are the bundled data set's rows.
    full = load_digits()
    for i in range(5):
        c = d.train_count[i]
        np.testing.assert_allclose(d.train["x"][i, :c], full.data[shards[i]] / 16.0, rtol=1e-6)
        np.testing.assert_array_equal(d.train["y"][i, :c], full.target[shards[i]])
    # Held-out and test sets are disjoint from training and from each other; sizes as configured.
    assert len(d.test["y"]) == 360 and len(d.heldout["y"]) == 180
    xs = {tuple(r) for r in np.round(d.test["x"] * 16).astype(int)}
    assert len(xs) > 300  # sanity: distinct images


def test_splits_deterministic_and_seeded():
    a, b = TASK.splits(4, seed=1), TASK.splits(4, seed=1)
    c = TASK.splits(4, seed=2)
    np.testing.assert_array_equal(a.meta["example_ids"], b.meta["example_ids"])
    assert not np.array_equal(a.train_count, c.train_count)
    # The test set does not depend on the partition seed.
    np.testing.assert_array_equal(a.test["y"], c.test["y"])


def test_dirichlet_alpha_controls_skew():
    d_skew = TASK.splits(8, seed=0, alpha=0.1)
    d_iid = TASK.splits(8, seed=0, alpha=100.0)
    assert d_skew.node_groups.sum(1).mean() < d_iid.node_groups.sum(1).mean()
    # Large alpha: every node's label histogram is close to the global one.
    global_hist = np.bincount(d_iid.general_groups, minlength=10) / len(d_iid.general_groups)
    for i in range(8):
        h = np.bincount(d_iid.train_groups[i, : d_iid.train_count[i]], minlength=10) / d_iid.train_count[i]
        assert np.abs(h - global_hist).sum() < 0.3


def test_dirichlet_partition_properties_and_errors():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(4), 50)
    shards = base.dirichlet_partition(groups, 6, 0.5, rng, min_size=2)
    cat = np.concatenate(shards)
    np.testing.assert_array_equal(np.sort(cat), np.arange(200))
    assert min(len(s) for s in shards) >= 2
    with pytest.raises(ValueError, match="alpha"):
        base.dirichlet_partition(groups, 6, 0.0, rng)
    with pytest.raises(ValueError, match="examples"):
        base.dirichlet_partition(groups, 300, 1.0, rng)


def test_dominant_groups_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        g = rng.integers(0, 6, size=rng.integers(1, 40))
        got = base.dominant_groups(g, 6, mass=0.7)
        counts = np.bincount(g, minlength=6)
        # Brute force: the smallest k such that the k largest groups cover 70%.
        srt = np.sort(counts)[::-1]
        k = int(np.argmax(np.cumsum(srt) >= 0.7 * len(g)) + 1)
        assert got.sum() == k
        assert counts[got].sum() >= 0.7 * len(g)
        assert counts[got].min() >= counts[~got].max(initial=0)


def test_process_split_loads_only_hosted_nodes():
    full = TASK.splits(4, seed=0, alpha=0.5)
    p0 = TASK.splits(4, seed=0, alpha=0.5, process_index=0, process_count=2)
    p1 = TASK.splits(4, seed=0, alpha=0.5, process_index=1, process_count=2)
    np.testing.assert_array_equal(p0.node_ids, [0, 1])
    np.testing.assert_array_equal(p1.node_ids, [2, 3])
    ids0, ids1 = p0.meta["example_ids"], p1.meta["example_ids"]
    assert not set(ids0[ids0 >= 0]) & set(ids1[ids1 >= 0])
    np.testing.assert_array_equal(np.concatenate([ids0, ids1]), full.meta["example_ids"])
    np.testing.assert_array_equal(np.concatenate([p0.train["x"], p1.train["x"]]), full.train["x"])
    with pytest.raises(ValueError, match="multiple of process_count"):
        TASK.splits(3, seed=0, process_count=2)
    with pytest.raises(ValueError, match="process_index"):
        TASK.splits(4, seed=0, process_index=2, process_count=2)


def test_loss_and_metrics_match_numpy():
    d = TASK.splits(1, seed=0)
    params = TASK.init(jax.random.key(3))
    x, y = d.heldout["x"], d.heldout["y"]
    logits = _np_forward(jax.tree.map(np.asarray, params), x)
    apply, metrics, loss = jax.jit(TASK.apply), jax.jit(TASK.metrics), jax.jit(TASK.loss)
    np.testing.assert_allclose(np.asarray(apply(params, jnp.asarray(x))), logits, rtol=1e-4, atol=1e-5)
    m = metrics(params, d.heldout)
    np.testing.assert_allclose(float(m["loss"]), _np_xent(logits, y).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["accuracy"]), (logits.argmax(-1) == y).mean(), rtol=1e-6)
    np.testing.assert_allclose(float(loss(params, d.heldout)), _np_xent(logits, y).mean(), rtol=1e-5)
    # The mask weighs rows: masked loss is the mean over the kept rows only.
    mask = np.arange(len(y)) % 3 == 0
    ml = loss(params, {**d.heldout, "mask": jnp.asarray(mask)})
    np.testing.assert_allclose(float(ml), _np_xent(logits, y)[mask].mean(), rtol=1e-5)
    # bfloat16 params compute in bfloat16 and stay close.
    lb = apply(base.cast_floating(params, jnp.bfloat16), jnp.asarray(x))
    assert lb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lb, np.float64), logits, atol=0.1)


def test_logical_axes_match_params_and_flip_labels():
    params = TASK.init(jax.random.key(0))
    axes = TASK.logical_axes(params)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_a = dict(
        (jax.tree_util.keystr(p), a)
        for p, a in jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda t: isinstance(t, tuple))[0]
    )
    for path, leaf in flat_p:
        names = flat_a[jax.tree_util.keystr(path)]
        assert len(names) == leaf.ndim
    assert flat_a["['dense_0']['kernel']"] == ("embed", "mlp")
    y = jnp.arange(10, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(TASK.flip_labels({"y": y})["y"]), 9 - np.arange(10))


def test_bad_configuration():
    with pytest.raises(ValueError, match="dropout"):
        DigitsTask(dropout=1.0)
    with pytest.raises(ValueError, match="fraction"):
        DigitsTask(test_fraction=0.6, heldout_fraction=0.5)
    assert isinstance(TASK, base.Task)


@pytest.mark.slow
def test_single_node_on_all_data_beats_90_percent():
    task = DigitsTask()  # 64-128-10
    d = task.splits(1, seed=0)
    trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=64)
    state = trainer.init(jax.random.key(0), task.init(jax.random.key(1)), 1)
    state, log = trainer.fit(state, d.own(), 400)
    acc = trainer.evaluate(state.params, d.test)["accuracy"][0]
    assert acc > 0.9, acc
    assert float(log.loss[-20:].mean()) < 0.3 * float(log.loss[:5].mean())
