"""Layer-wise convex weights: one group is the task-wise QP; per-leaf groups are independent task-wise QPs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import consensus
from consensus.convex.curvature import LossModel


def setup(seed=0, n=4):
    rng = np.random.default_rng(seed)
    base = {
        "a": rng.standard_normal((6, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    stacked = consensus.stack(
        [
            jax.tree.map(lambda p: (p + 0.5 * rng.standard_normal(p.shape)).astype(np.float32), base)
            for _ in range(n)
        ]
    )
    grad = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), base)
    curv = jax.tree.map(lambda p: jnp.asarray(rng.uniform(0.5, 2.0, p.shape).astype(np.float32)), base)

    def model_fn(ref, **extra):
        return LossModel(jnp.float32(0.0), grad, curv)

    return base, stacked, grad, curv, model_fn


@pytest.mark.slow
def test_one_group_is_the_task_wise_qp():
    base, stacked, grad, curv, model_fn = setup()
    agg = consensus.layerwise_weights(model_fn, groups="all")
    merged, state = agg.update(stacked, agg.init(base), base)
    ref = consensus.weighted_sum(stacked, jnp.full((4,), 0.25, jnp.float32))
    want = consensus.quadratic_weights(stacked, ref, grad, curv).weights
    np.testing.assert_allclose(state.result.weights[0], want, atol=1e-5)
    expected = consensus.weighted_sum(stacked, jnp.asarray(state.result.weights[0], jnp.float32))
    for a, b in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_weight", [None, 0.4])
def test_per_leaf_groups_are_independent_qps(max_weight):
    base, stacked, grad, curv, model_fn = setup(1)
    agg = consensus.layerwise_weights(model_fn, max_weight=max_weight)
    merged, state = agg.update(stacked, agg.init(base), base)
    ref = consensus.weighted_sum(stacked, jnp.full((4,), 0.25, jnp.float32))
    assert state.result.groups == ("['a']", "['b']") and not state.result.fallback
    for g, key in enumerate(("a", "b")):
        one = lambda t, key=key: {key: t[key]}  # noqa: E731
        want = consensus.quadratic_weights(
            one(stacked), one(ref), one(grad), one(curv), max_weight=max_weight
        )
        np.testing.assert_allclose(state.result.weights[g], want.weights, atol=5e-5)  # solver tolerance
        leaf = np.einsum("i,i...->...", state.result.weights[g], np.asarray(stacked[key], np.float64))
        np.testing.assert_allclose(np.asarray(merged[key]), leaf, rtol=1e-5, atol=1e-5)
    assert np.all(state.result.weights >= -1e-9) and np.allclose(state.result.weights.sum(1), 1.0)
    if max_weight is not None:
        assert state.result.weights.max() <= max_weight + 1e-7


def test_masked_node_gets_no_weight_and_groups_by_module():
    base, stacked, grad, curv, model_fn = setup(2)
    agg = consensus.layerwise_weights(model_fn, groups=lambda path: "all-but-name")
    _, state = agg.update(stacked, agg.init(base), base, mask=jnp.asarray([True, False, True, True]))
    assert state.result.weights[:, 1].max() == 0.0
    with pytest.raises(ValueError, match="groups must be"):
        consensus.layerwise_weights(model_fn, groups="nope").update(stacked, None, base)
