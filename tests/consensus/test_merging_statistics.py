"""Node-side statistics for Fisher merging and RegMean against closed-form numpy gradients."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import consensus
from strategies.statistics import mlp_layer_inputs, node_statistics
from strategies.tasks.digits import DigitsTask


def softmax(z):
    z = z - z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


@pytest.mark.slow
def test_fisher_and_grams_of_a_two_layer_mlp_match_closed_forms():
    task = DigitsTask(hidden=(8,))
    params = task.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (37, 64)).astype(np.float32)
    y = rng.integers(0, 10, 37).astype(np.int32)
    stats = node_statistics(task.loss, params, {"x": x, "y": y}, chunk_size=8)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x64 = x.astype(np.float64)
    h_pre = x64 @ p["dense_0"]["kernel"] + p["dense_0"]["bias"]
    h = np.maximum(h_pre, 0)
    probs = softmax(h @ p["dense_1"]["kernel"] + p["dense_1"]["bias"])
    delta2 = probs - np.eye(10)[y]  # d loss / d logits, per example
    delta1 = (delta2 @ p["dense_1"]["kernel"].T) * (h_pre > 0)
    want = {
        ("dense_1", "kernel"): np.mean([np.outer(h[i], delta2[i]) ** 2 for i in range(37)], 0),
        ("dense_1", "bias"): np.mean(delta2**2, 0),
        ("dense_0", "kernel"): np.mean([np.outer(x64[i], delta1[i]) ** 2 for i in range(37)], 0),
        ("dense_0", "bias"): np.mean(delta1**2, 0),
    }
    for (layer, leaf), w in want.items():
        np.testing.assert_allclose(np.asarray(stats.fisher[layer][leaf]), w, rtol=2e-4, atol=1e-8)
    np.testing.assert_allclose(np.asarray(stats.grams["['dense_0']['kernel']"]), x64.T @ x64, rtol=1e-5)
    g1 = np.asarray(stats.grams["['dense_1']['kernel']"])
    np.testing.assert_allclose(g1, h.T @ h, rtol=1e-4, atol=1e-5)
    assert stats.count == 37
    # The keys are what regmean reads.
    nodes = consensus.stack([params, params])
    grams = {k: np.stack([v, v]) for k, v in stats.grams.items()}
    merged, _ = consensus.regmean().update(nodes, None, params, grams=grams)
    np.testing.assert_allclose(np.asarray(merged["dense_0"]["kernel"]), p["dense_0"]["kernel"], atol=1e-6)


def test_mlp_layer_inputs_refuses_other_models():
    with pytest.raises(ValueError, match="dense_0"):
        mlp_layer_inputs({"conv": {"kernel": np.zeros((3, 3))}}, np.zeros((2, 3)))
