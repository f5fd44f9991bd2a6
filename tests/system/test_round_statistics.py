"""Per-node statistics in the system's round: fisher_merge and regmean as vote.rule in a run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from consensus import tree
from meta_consensus import config
from meta_consensus import stages as stages_module
from meta_consensus.coordinator import Coordinator
from meta_consensus.server import round_needs
from meta_consensus.statistics import check_plain_mlp, node_batch, round_statistics

TINY = [
    "rounds=1",
    "seed=3",
    "checkpoint_every=0",
    "baseline_fedavg=false",
    "task.options.hidden=[8]",
    "task.alpha=0.5",
    "nodes.count=3",
    "byzantine.nodes=[]",
    "nodes.strategies=local",
    "nodes.local_steps=3",
    "nodes.learning_rate=0.05",
    "weights.objective=vote",
    "vote.server_step=0",  # the rules' own needs (the default's server step adds the root-set update)
]


def tiny(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*TINY, f"output_dir={tmp_path}", "name=stats", *overrides])


def _run_one_round(cfg, monkeypatch):
    """One round; returns (base, the submitted stack, the statistics the round carried, the new consensus)."""
    seen = {}

    def spy(needs, task, data, submitted):
        out = round_statistics(needs, task, data, submitted)
        seen.update(submitted=submitted, stats=out, data=data, task=task)
        return out

    monkeypatch.setattr(stages_module, "round_statistics", spy)
    co = Coordinator(cfg)
    state = co.init(jax.random.key(cfg.seed))
    new_state, info = co.round(state)
    assert info.ok, info.reason
    return state.consensus, seen, new_state.consensus


def _leaves64(t):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]


def test_config_accepts_fisher_and_regmean_and_refuses_dp(tmp_path):
    assert round_needs(tiny(tmp_path, "vote.rule=fisher_merge")) == {"fisher"}
    assert round_needs(tiny(tmp_path, "vote.rule=regmean")) == {"grams"}
    assert round_needs(tiny(tmp_path, "vote.rule=mean")) == frozenset()
    cfg = tiny(tmp_path, "vote.rule=fisher_merge", "dp.enabled=true", "dp.noise_multiplier=1.0")
    with pytest.raises(config.ConfigError, match="not differentially private"):
        Coordinator(cfg)


@pytest.mark.slow  # a coordinator, a round and per-example gradients of 3 nodes: ~30 s on 2 loaded cores
def test_fisher_merge_round_uses_each_nodes_fisher_on_its_own_shard(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "vote.rule=fisher_merge")
    base, seen, merged = _run_one_round(cfg, monkeypatch)
    submitted, fisher, data = seen["submitted"], seen["stats"]["fisher"], seen["data"]
    assert set(seen["stats"]) == {"fisher"}
    # Node 1's Fisher, brute force: the mean over its own rows of the squared per-example gradient.
    params1 = jax.tree.map(lambda a: a[1], submitted)
    rows = node_batch(data.train, np.asarray(data.train_count), 1)
    # One vmapped gradient per example (no chunks, no padding: not the statistics' own code path).
    loss = seen["task"].loss
    one = jax.vmap(jax.grad(lambda p, x, y: loss(p, {"x": x[None], "y": y[None]})), in_axes=(None, 0, 0))
    per_example = one(params1, jnp.asarray(rows["x"]), jnp.asarray(rows["y"]))
    brute = [np.mean(np.asarray(g, np.float64) ** 2, axis=0) for g in jax.tree_util.tree_leaves(per_example)]
    for got, want in zip(_leaves64(jax.tree.map(lambda a: a[1], fisher)), brute, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-9)
    # The consensus is the Fisher-weighted mean of the candidates (float64, epsilon = 1e-8).
    for x, f, out in zip(_leaves64(submitted), _leaves64(fisher), _leaves64(merged), strict=True):
        w = np.maximum(f, 0.0) + 1e-8
        np.testing.assert_allclose(out, (w * x).sum(0) / w.sum(0), rtol=1e-4, atol=1e-6)
    assert not np.allclose(_leaves64(merged)[0], _leaves64(base)[0])


@pytest.mark.slow  # a coordinator, a round and per-node statistics of 3 nodes: ~10 s on 2 shared cores
def test_regmean_round_solves_the_least_squares_merge_of_the_dense_layers(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "vote.rule=regmean")
    base, seen, merged = _run_one_round(cfg, monkeypatch)
    submitted, grams, data = seen["submitted"], seen["stats"]["grams"], seen["data"]
    count = np.asarray(data.train_count)
    paths = tree.leaf_paths(base)
    kernels = [p for p in paths if p.endswith("['kernel']")]
    assert sorted(grams) == sorted(kernels)
    xs = dict(zip(paths, _leaves64(submitted), strict=True))
    out = dict(zip(paths, _leaves64(merged), strict=True))
    # The first layer's Gram of node 0 is X^T X of its own raw rows (digits: already floats).
    x0 = node_batch(data.train, count, 0)["x"].reshape(int(count[0]), -1).astype(np.float64)
    first = "['dense_0']['kernel']"
    np.testing.assert_allclose(np.asarray(grams[first][0], np.float64), x0.T @ x0, rtol=1e-4, atol=1e-3)
    for p in paths:
        if p in grams:
            g = np.asarray(grams[p], np.float64)
            # W = argmin sum_i ||X_i W - X_i W_i||^2 = (sum G_i)^-1 sum G_i W_i (lstsq on the stacked
            # rows X_i^T X_i = G_i: a rank-safe solve, independent of the rule's own).
            want = np.linalg.lstsq(g.sum(0), np.einsum("nij,njk->ik", g, xs[p]), rcond=None)[0]
            # Compare the layer's outputs on the nodes' inputs (the least-squares objective's
            # directions), not the kernel entries the data never touches.
            resid_got = sum(np.trace((out[p] - xs[p][i]).T @ g[i] @ (out[p] - xs[p][i])) for i in range(3))
            resid_want = sum(np.trace((want - xs[p][i]).T @ g[i] @ (want - xs[p][i])) for i in range(3))
            assert resid_got <= resid_want * (1 + 1e-3) + 1e-6
        else:  # biases: the plain mean of the candidates
            np.testing.assert_allclose(out[p], xs[p].mean(0), rtol=1e-4, atol=1e-6)


def test_regmean_refuses_a_model_that_is_not_a_plain_mlp_on_its_inputs():
    class Scaled:
        name = "scaled"

        def apply(self, params, x):
            h = jax.nn.relu((2.0 * x) @ params["dense_0"]["kernel"] + params["dense_0"]["bias"])
            return h @ params["dense_1"]["kernel"] + params["dense_1"]["bias"]

    rng = np.random.default_rng(0)
    params = {
        "dense_0": {"kernel": rng.normal(size=(4, 3)).astype(np.float32), "bias": np.zeros(3, np.float32)},
        "dense_1": {"kernel": rng.normal(size=(3, 2)).astype(np.float32), "bias": np.zeros(2, np.float32)},
    }
    x = rng.normal(size=(5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="plain ReLU MLP"):
        check_plain_mlp(Scaled(), params, x)
    with pytest.raises(ValueError, match="plain MLP task"):
        check_plain_mlp(Scaled(), {"conv": params["dense_0"]}, x)
