"""Held-out loss, gradient and diagonal curvature against closed forms and explicit Jacobians."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from consensus.convex.curvature import empirical_fisher, softmax_gauss_newton

D, C, M = 5, 4, 37  # 37 examples: not a multiple of the chunk size, so padding is exercised


def softmax_regression_logits(p, x):
    return x @ p["w"] + p["b"]


def softmax_regression_loss(p, ex):
    z = softmax_regression_logits(p, ex["x"])
    return jax.nn.logsumexp(z) - z[ex["y"]]


def data(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(D, C)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=C), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    y = jnp.asarray(rng.integers(0, C, size=M), jnp.int32)
    return params, x, y


def closed_form(params, x, y):
    """float64 numpy: loss, grads, diagonal GN (= Fisher) and empirical Fisher of softmax regression."""
    w, b, x = (np.asarray(a, np.float64) for a in (params["w"], params["b"], x))
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(C)[np.asarray(y)]
    loss = float(np.mean(-np.log(p[np.arange(M), np.asarray(y)])))
    r = p - onehot
    grad = {"w": x.T @ r / M, "b": r.mean(0)}
    v = p * (1 - p)
    gn = {"w": (x**2).T @ v / M, "b": v.mean(0)}
    ef = {"w": (x**2).T @ r**2 / M, "b": (r**2).mean(0)}
    return loss, grad, gn, ef


def test_gauss_newton_matches_closed_form_softmax_regression():
    params, x, y = data()
    loss, grad, gn, _ = closed_form(params, x, y)
    model = softmax_gauss_newton(softmax_regression_logits, params, x, y, chunk_size=8)
    assert float(model.loss) == pytest.approx(loss, rel=1e-5)
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(model.grad[k]), grad[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(model.curvature[k]), gn[k], rtol=1e-4, atol=1e-6)
        assert model.curvature[k].dtype == jnp.float32


def test_empirical_fisher_matches_closed_form_and_chunking_is_invisible():
    params, x, y = data(1)
    loss, grad, _, ef = closed_form(params, x, y)
    batch = {"x": x, "y": y}
    a = empirical_fisher(softmax_regression_loss, params, batch, chunk_size=8)
    b = empirical_fisher(softmax_regression_loss, params, batch, chunk_size=M)
    assert float(a.loss) == pytest.approx(loss, rel=1e-5)
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(a.grad[k]), grad[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a.curvature[k]), ef[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(a.curvature[k]), np.asarray(b.curvature[k]), rtol=1e-5, atol=1e-7
        )


def mlp_logits(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def test_gauss_newton_matches_explicit_jacobian_for_an_mlp():
    rng = np.random.default_rng(2)
    params = {
        "w1": jnp.asarray(rng.normal(size=(D, 3)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=3), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(3, C)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(9, D)), jnp.float32)
    y = jnp.asarray(rng.integers(0, C, size=9), jnp.int32)
    model = softmax_gauss_newton(mlp_logits, params, x, y, chunk_size=4)
    flat, unravel = ravel_pytree(params)
    # Reference: full (C, P) Jacobian per example, J^T (diag p - p p^T) J in float64.
    jac_fn = jax.jit(jax.jacrev(lambda f, xj: mlp_logits(unravel(f), xj)))
    h = np.zeros(flat.shape[0])
    for j in range(9):
        jac = np.asarray(jac_fn(flat, x[j]), np.float64)
        z = np.asarray(mlp_logits(params, x[j]), np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        h += np.diag(jac.T @ (np.diag(p) - np.outer(p, p)) @ jac) / 9
    got, _ = ravel_pytree(model.curvature)
    np.testing.assert_allclose(np.asarray(got), h, rtol=1e-4, atol=1e-6)


def test_input_errors():
    params, x, y = data()
    with pytest.raises(TypeError, match="integer"):
        softmax_gauss_newton(softmax_regression_logits, params, x, y.astype(jnp.float32))
    with pytest.raises(ValueError, match="disagree"):
        softmax_gauss_newton(softmax_regression_logits, params, x, y[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        empirical_fisher(softmax_regression_loss, params, {"x": x, "y": y}, chunk_size=0)
