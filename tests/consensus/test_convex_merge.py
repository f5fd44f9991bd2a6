"""convex_merge as an aggregator, with each weigher, against numpy/scipy references."""

from __future__ import annotations

import cvxpy as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from consensus.aggregators import geometric_median, trimmed_mean
from consensus.base import get_info
from consensus.convex.curvature import LossModel
from consensus.convex.merge import anchor_weigher, convex_merge, mixture_nll_weigher, quadratic_weigher
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import ProblemCache

N = 6
SHAPES = {"w": (4, 3), "b": (3,)}


def nodes(seed, scale=0.5):
    rng = np.random.default_rng(seed)
    ref = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    stacked = {
        k: jnp.asarray(v[None] + scale * rng.normal(size=(N, *v.shape)), jnp.float32) for k, v in ref.items()
    }
    return stacked, {k: jnp.asarray(v, jnp.float32) for k, v in ref.items()}


def flat_nodes(stacked):
    return np.concatenate([np.asarray(stacked[k], np.float64).reshape(N, -1) for k in SHAPES], axis=1)


def flat(t):
    return np.concatenate([np.asarray(t[k], np.float64).reshape(-1) for k in SHAPES])


def slsqp(fun, jac, ub):
    n = ub.shape[0]
    res = optimize.minimize(
        fun,
        (ub > 0) / (ub > 0).sum(),
        jac=jac,
        method="SLSQP",
        bounds=[(0.0, u) for u in ub],
        constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0, "jac": lambda w: np.ones(n)}],
        options={"ftol": 1e-15, "maxiter": 2000},
    )
    assert res.success
    return res.x, float(res.fun)


# An exactly quadratic held-out loss L(theta) = 1/2 sum h (theta - t)^2: its quadratic model is exact.
TARGET = {k: jnp.asarray(np.random.default_rng(99).normal(size=s), jnp.float32) for k, s in SHAPES.items()}
CURV = {
    k: jnp.asarray(0.5 + np.random.default_rng(98).uniform(size=s), jnp.float32) for k, s in SHAPES.items()
}


def exact_model(ref, scale=1.0):
    d = jax.tree.map(jnp.subtract, ref, TARGET)
    h = jax.tree.map(lambda c: c * jnp.float32(scale), CURV)
    loss = sum(
        jnp.sum(0.5 * hh * dd**2) for hh, dd in zip(jax.tree.leaves(h), jax.tree.leaves(d), strict=True)
    )
    return LossModel(loss, jax.tree.map(jnp.multiply, h, d), h)


def true_loss(theta_flat):
    return float(0.5 * np.sum(flat(CURV) * (theta_flat - flat(TARGET)) ** 2))


def test_quadratic_merge_minimizes_true_loss_and_reports_info():
    stacked, _ = nodes(0)
    stacked = {k: v.at[2].set(jnp.inf) if k == "b" else v for k, v in stacked.items()}  # node 2 is broken
    mask = jnp.asarray([True, True, True, True, False, True])  # node 4 voted out
    agg = convex_merge(quadratic_weigher(exact_model, max_weight=0.45, cache=ProblemCache()))
    state = agg.init(None)
    assert state.result is None
    merged, state = agg.update(stacked, state, mask=mask, scale=1.0)
    res = state.result
    info = get_info(state)
    valid = np.array([True, True, False, True, False, True])
    np.testing.assert_array_equal(np.asarray(info.valid), valid)
    np.testing.assert_array_equal(np.asarray(info.selected), valid)
    np.testing.assert_allclose(np.asarray(info.weights), res.weights, atol=1e-7)
    assert res.weights[2] == 0.0 and res.weights[4] == 0.0 and not res.fallback
    x = flat_nodes(stacked)
    x_ok = x[valid]
    np.testing.assert_allclose(flat(merged), res.weights[valid] @ x_ok, rtol=1e-5, atol=1e-5)
    # Reference: scipy on the true loss over the valid nodes, caps included.
    hv, tv = flat(CURV), flat(TARGET)
    w_ref, f_ref = slsqp(
        lambda w: true_loss(w @ x_ok), lambda w: x_ok @ (hv * (w @ x_ok - tv)), np.full(valid.sum(), 0.45)
    )
    assert true_loss(flat(merged)) == pytest.approx(f_ref, rel=1e-4)
    assert true_loss(flat(merged)) <= true_loss(x_ok.mean(0)) + 1e-6
    np.testing.assert_allclose(res.weights[valid], w_ref, atol=1e-3)
    assert agg.sensitivity(1.5, 10) == 3.0


def test_solver_failure_is_reported_in_state_and_merge_is_uniform(monkeypatch):
    stacked, _ = nodes(1)
    cache = ProblemCache()
    agg = convex_merge(quadratic_weigher(exact_model, cache=cache))
    agg.update(stacked, agg.init(None))  # compile
    compiled = cache[cache.keys()[0]]

    def boom(*a, **k):
        raise cp.error.SolverError("simulated")

    monkeypatch.setattr(compiled.problem, "solve", boom)
    merged, state = agg.update(stacked, agg.init(None))
    assert state.result.fallback and "simulated" in state.result.message
    np.testing.assert_allclose(flat(merged), flat_nodes(stacked).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(get_info(state).weights), np.full(N, 1 / N), rtol=1e-6)


def test_infeasible_cap_raises_through_update():
    stacked, _ = nodes(2)
    agg = convex_merge(quadratic_weigher(exact_model, max_weight=0.19))
    with pytest.raises(ValueError, match="5 accepted nodes"):
        agg.update(stacked, agg.init(None), mask=jnp.asarray([True] * 5 + [False]))


def prob_fn(p, x, y):
    probs = jax.nn.softmax(x @ p["w"] + p["b"])
    return jnp.take_along_axis(probs, y[:, None], axis=1)[:, 0]


def test_mixture_weigher_uses_each_nodes_predictions():
    stacked, _ = nodes(3, scale=1.0)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(40, 4)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, size=40), jnp.int32)
    agg = convex_merge(mixture_nll_weigher(prob_fn, max_weight=0.5))
    merged, state = agg.update(stacked, agg.init(None), x=x, y=y)
    # Reference probabilities in float64 numpy, node by node.
    xs = np.asarray(x, np.float64)
    probs = []
    for i in range(N):
        z = xs @ np.asarray(stacked["w"][i], np.float64) + np.asarray(stacked["b"][i], np.float64)
        e = np.exp(z - z.max(1, keepdims=True))
        probs.append((e / e.sum(1, keepdims=True))[np.arange(40), np.asarray(y)])
    ref = mixture_nll_weights(np.array(probs), max_weight=0.5)
    np.testing.assert_allclose(state.result.weights, ref.weights, atol=1e-4)
    np.testing.assert_allclose(flat(merged), state.result.weights @ flat_nodes(stacked), rtol=1e-5, atol=1e-5)


def weiszfeld(x, iters=5000):
    z = x.mean(0)
    for _ in range(iters):
        d = np.maximum(np.linalg.norm(x - z, axis=1), 1e-12)
        z = ((1 / d) / np.sum(1 / d)) @ x
    return z


def test_anchor_weigher_geometric_median_and_trimmed_mean():
    stacked, _ = nodes(5)
    stacked = jax.tree.map(lambda v: v.at[0].add(20.0), stacked)  # node 0 is an outlier
    x = flat_nodes(stacked)
    cap = 0.3
    for anchor_rule, anchor_ref in [
        (geometric_median(max_iter=500, tol=1e-9), weiszfeld(x)),
        (trimmed_mean(1), np.sort(x, axis=0)[1:-1].mean(0)),
    ]:
        agg = convex_merge(anchor_weigher(anchor_rule, max_weight=cap))
        merged, state = agg.update(stacked, agg.init(None))
        _, f_ref = slsqp(
            lambda w, a=anchor_ref: float(np.sum((w @ x - a) ** 2)),
            lambda w, a=anchor_ref: 2 * x @ (w @ x - a),
            np.full(N, cap),
        )
        got = float(np.sum((flat(merged) - anchor_ref) ** 2))
        assert got == pytest.approx(f_ref, rel=5e-3, abs=1e-6), anchor_rule.name
        assert state.result.weights[0] < 0.05, anchor_rule.name  # the outlier is left out
        assert np.all(state.result.weights <= cap + 1e-12)
