"""Tests for strategies.convexity: prox, L2-ball projection, the constrained optimizer, loss barriers.

References are independent: scipy minimizers, float64 numpy closed forms, brute force,
and a hand-written float64 numpy proximal-gradient loop for softmax regression.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from sklearn.datasets import load_digits

from consensus import tree as ctree
from strategies import convexity as cv

# ----------------------------------------------------------------------------- helpers


def _tree(rng: np.random.Generator, scale: float = 1.0) -> dict:
    return {
        "a": jnp.asarray(rng.normal(size=(3,)) * scale, jnp.float32),
        "b": {"c": jnp.asarray(rng.normal(size=(2, 2)) * scale, jnp.float32)},
    }


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _unflat(vec: np.ndarray, like) -> dict:
    leaves, tdef = jax.tree_util.tree_flatten(like)
    out, i = [], 0
    for x in leaves:
        out.append(jnp.asarray(vec[i : i + x.size].reshape(x.shape), jnp.float32))
        i += x.size
    return jax.tree_util.tree_unflatten(tdef, out)


@functools.cache
def _digits():
    X, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(y))
    X = (X[perm] / 16.0).astype(np.float32)
    y = y[perm].astype(np.int32)
    return X[:600], y[:600], X[600:900], y[600:900]


def _softmax_ce(params, batch):
    """Mean softmax cross-entropy of a linear model (convex in the params)."""
    logits = batch["x"] @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def _np_softmax_ce(w: np.ndarray, b: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, tuple]:
    """Float64 numpy loss and gradient of _softmax_ce (independent reference)."""
    X = X.astype(np.float64)
    z = X @ w + b
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    m = len(y)
    loss = -np.mean(np.log(p[np.arange(m), y]))
    p[np.arange(m), y] -= 1.0
    return loss, (X.T @ p / m, p.mean(axis=0))


def _lr_params(rng: np.random.Generator, scale: float) -> dict:
    return {
        "w": jnp.asarray(rng.normal(size=(64, 10)) * scale, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(10,)) * scale, jnp.float32),
    }


# ----------------------------------------------------------------------------- proximal step


@pytest.mark.parametrize("lr,mu", [(0.1, 0.5), (1.0, 3.0), (0.05, 200.0)])
def test_proximal_step_is_the_minimizer(lr, mu):
    rng = np.random.default_rng(1)
    v, a = _tree(rng), _tree(rng, scale=2.0)
    out = _flat(cv.proximal_step(v, a, mu, lr))
    vf, af = _flat(v), _flat(a)

    def obj(t):
        return (0.5 / lr) * np.sum((t - vf) ** 2) + 0.5 * mu * np.sum((t - af) ** 2)

    def grad(t):
        return (t - vf) / lr + mu * (t - af)

    res = scipy.optimize.minimize(
        obj, np.zeros_like(vf), jac=grad, method="L-BFGS-B", options={"gtol": 1e-12}
    )
    assert res.success
    np.testing.assert_allclose(out, res.x, atol=2e-5)
    # The same point from the float64 closed form.
    np.testing.assert_allclose(out, (vf + lr * mu * af) / (1 + lr * mu), rtol=1e-6, atol=1e-6)


def test_proximal_step_identity_at_mu_zero_and_jit_vmap():
    rng = np.random.default_rng(2)
    v, a = _tree(rng), _tree(rng)
    same = cv.proximal_step(v, a, 0.0, 0.3)
    for x, y in zip(jax.tree_util.tree_leaves(same), jax.tree_util.tree_leaves(v), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Per-node mu and lr under vmap equal per-node calls.
    nodes = [_tree(rng) for _ in range(3)]
    anchors = [_tree(rng) for _ in range(3)]
    mus, lrs = np.array([0.0, 1.0, 10.0], np.float32), np.array([0.1, 0.5, 2.0], np.float32)
    stacked = jax.jit(jax.vmap(cv.proximal_step))(ctree.stack(nodes), ctree.stack(anchors), mus, lrs)
    for i in range(3):
        ref = cv.proximal_step(nodes[i], anchors[i], float(mus[i]), float(lrs[i]))
        np.testing.assert_allclose(_flat(jax.tree.map(lambda x, i=i: x[i], stacked)), _flat(ref), rtol=1e-6)


def test_prox_is_stable_where_the_gradient_penalty_diverges():
    # f = 0, so only the pull towards the anchor acts: with lr * mu = 3 the gradient form multiplies the
    # distance by |1 - 3| = 2 per step while the prox multiplies it by 1 / (1 + 3).
    rng = np.random.default_rng(3)
    theta, a = _tree(rng), _tree(rng)
    d0 = float(cv.tree_distance(theta, a))
    lr, mu, steps = 1.0, 3.0, 6  # few steps: far above float32 rounding near the anchor
    prox, grad = theta, theta
    for _ in range(steps):
        prox = cv.proximal_step(prox, a, mu, lr)
        grad = jax.tree.map(lambda t, c: t - lr * mu * (t - c), grad, a)
    np.testing.assert_allclose(float(cv.tree_distance(prox, a)), d0 * 0.25**steps, rtol=1e-4)
    assert float(cv.tree_distance(grad, a)) > d0 * 2.0 ** (steps - 1)


# ----------------------------------------------------------------------------- projection


def _scipy_nearest_in_ball(v: np.ndarray, a: np.ndarray, r: float):
    """argmin ||t - v||^2 s.t. ||t - a||^2 <= r^2 by a generic constrained solver (float64)."""
    k = a.size
    ball = scipy.optimize.NonlinearConstraint(
        lambda t: np.sum((t - a) ** 2),
        -np.inf,
        r**2,
        jac=lambda t: 2 * (t - a),
        hess=lambda t, lam: 2 * lam[0] * np.eye(k),
    )
    return scipy.optimize.minimize(
        lambda t: np.sum((t - v) ** 2),
        a,
        jac=lambda t: 2 * (t - v),
        hess=lambda t: 2 * np.eye(k),
        constraints=[ball],
        method="trust-constr",
        options={"gtol": 1e-12, "xtol": 1e-14, "maxiter": 2000},
    )


def test_projection_is_the_nearest_point_in_the_ball():
    rng = np.random.default_rng(4)
    a = _tree(rng)
    af = _flat(a)
    r = 1.5
    for scale in (0.3, 2.0, 10.0):
        v = jax.tree.map(lambda x, s=scale: x + jnp.asarray(rng.normal(size=x.shape) * s, jnp.float32), a)
        vf = _flat(v)
        p = cv.project_l2_ball(v, a, r)
        pf = _flat(p)
        d = np.linalg.norm(vf - af)
        if d <= r:
            for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(v), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # exact no-op inside
            continue
        # In the ball (on the sphere), equal to the float64 formula.
        np.testing.assert_allclose(np.linalg.norm(pf - af), r, rtol=1e-6)
        np.testing.assert_allclose(pf, af + (r / d) * (vf - af), rtol=1e-5, atol=1e-6)
        # Nearest point: a constrained scipy solver agrees ...
        res = _scipy_nearest_in_ball(vf, af, r)
        assert res.success
        np.testing.assert_allclose(pf, res.x, atol=1e-4)
        # ... and no point of a dense random sample of the ball is closer.
        u = rng.normal(size=(4000, af.size))
        u *= (r * rng.uniform(size=(4000, 1)) ** (1 / af.size)) / np.linalg.norm(u, axis=1, keepdims=True)
        sample_d = np.linalg.norm(af + u - vf, axis=1)
        assert np.linalg.norm(pf - vf) <= sample_d.min() + 1e-5
        # Idempotent.
        np.testing.assert_allclose(_flat(cv.project_l2_ball(p, a, r)), pf, rtol=1e-6, atol=1e-6)


def test_projection_uses_the_global_norm_not_per_leaf():
    a = {"x": jnp.zeros((2,), jnp.float32), "y": jnp.zeros((2,), jnp.float32)}
    v = {"x": jnp.asarray([0.9, 0.0], jnp.float32), "y": jnp.asarray([0.0, 0.9], jnp.float32)}
    p = cv.project_l2_ball(v, a, 1.0)
    # Each leaf is inside the ball on its own, the tree is not (norm 0.9 * sqrt 2): one common scale.
    np.testing.assert_allclose(_flat(p), _flat(v) / (0.9 * np.sqrt(2.0)), rtol=1e-6)


def test_convex_combinations_of_projected_nodes_stay_in_the_ball():
    rng = np.random.default_rng(5)
    n, r = 6, 0.7
    a = _tree(rng)
    nodes = ctree.stack([jax.tree.map(lambda x: x * 3.0, _tree(rng)) for _ in range(n)])
    anchors = ctree.broadcast(a, n)
    proj = jax.jit(jax.vmap(cv.project_l2_ball))(nodes, anchors, jnp.full((n,), r, jnp.float32))
    assert np.all(np.asarray(jax.jit(jax.vmap(cv.tree_distance))(proj, anchors)) <= r * (1 + 1e-6))
    weights = jnp.asarray(rng.dirichlet(np.ones(n), size=30), jnp.float32)
    merged_dist = jax.jit(jax.vmap(lambda w: cv.tree_distance(ctree.weighted_sum(proj, w), a)))(weights)
    assert np.all(np.asarray(merged_dist) <= r * (1 + 1e-5))
    # Per-node anchors and radii under vmap, against the float64 formula (inf radius: untouched, bit for bit).
    radii = np.array([0.1, 0.5, 1.0, 2.0, 5.0, np.inf], np.float32)
    own = ctree.stack([_tree(rng) for _ in range(n)])
    out = jax.jit(jax.vmap(cv.project_l2_ball))(nodes, own, radii)
    for i in range(n):
        x, c = _flat(jax.tree.map(lambda t, i=i: t[i], nodes)), _flat(jax.tree.map(lambda t, i=i: t[i], own))
        d = np.linalg.norm(x - c)
        ref = c + (radii[i] / d) * (x - c) if d > radii[i] else x
        np.testing.assert_allclose(_flat(jax.tree.map(lambda t, i=i: t[i], out)), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        _flat(jax.tree.map(lambda x: x[-1], out)), _flat(jax.tree.map(lambda x: x[-1], nodes))
    )


# ----------------------------------------------------------------------------- the optimizer


def test_constrained_sgd_equals_numpy_proximal_projected_gradient():
    Xtr, ytr, _, _ = _digits()
    X, y = Xtr[:200], ytr[:200]
    rng = np.random.default_rng(6)
    params, anchor = _lr_params(rng, 0.05), _lr_params(rng, 0.05)
    lr, mu, r = 0.5, 0.1, 0.6
    opt = cv.convex_constrained(optax.sgd(lr), mu=mu, radius=r, learning_rate=lr)
    state = opt.init(params)
    batch = {"x": jnp.asarray(X), "y": jnp.asarray(y)}

    @jax.jit
    def step(p, s):
        g = jax.grad(_softmax_ce)(p, batch)
        u, s = opt.update(g, s, p, anchor=anchor)
        return optax.apply_updates(p, u), s

    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    aw, ab = np.asarray(anchor["w"], np.float64), np.asarray(anchor["b"], np.float64)
    projected = 0
    for _ in range(8):
        params, state = step(params, state)
        _, (gw, gb) = _np_softmax_ce(w, b, X, y)
        w, b = w - lr * gw, b - lr * gb
        w, b = (w + lr * mu * aw) / (1 + lr * mu), (b + lr * mu * ab) / (1 + lr * mu)
        d = np.sqrt(np.sum((w - aw) ** 2) + np.sum((b - ab) ** 2))
        if d > r:
            projected += 1
            w, b = aw + (r / d) * (w - aw), ab + (r / d) * (b - ab)
        np.testing.assert_allclose(np.asarray(params["w"]), w, atol=2e-5)
        np.testing.assert_allclose(np.asarray(params["b"]), b, atol=2e-5)
    assert projected >= 3  # the test exercises the projection, not only the prox


def test_constrained_training_stays_in_the_ball_at_every_step():
    Xtr, ytr, _, _ = _digits()
    batch = {"x": jnp.asarray(Xtr), "y": jnp.asarray(ytr)}
    rng = np.random.default_rng(7)
    n, steps = 3, 40
    anchors = ctree.stack([_lr_params(rng, 0.01) for _ in range(n)])
    radii = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    mus = jnp.asarray([0.0, 0.1, 1.0], jnp.float32)
    opt = cv.convex_constrained(optax.sgd(0.5, momentum=0.9), radius=1.0, learning_rate=0.5)

    def run(anchor, radius, mu):
        params = anchor
        state = opt.init(params)

        def body(carry, _):
            p, s = carry
            g = jax.grad(_softmax_ce)(p, batch)
            u, s = opt.update(g, s, p, anchor=anchor, radius=radius, mu=mu)
            p = optax.apply_updates(p, u)
            return (p, s), (cv.tree_distance(p, anchor), _softmax_ce(p, batch))

        (_, _), (dist, loss) = jax.lax.scan(body, (params, state), None, length=steps)
        return dist, loss, _softmax_ce(anchor, batch)

    # One compiled run; the unconstrained reference uses radius inf and mu 0 (exact no-ops).
    runs = jax.jit(jax.vmap(run))
    dist, loss, loss0 = runs(anchors, radii, mus)
    free_dist, _, _ = runs(anchors, jnp.full((n,), jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    dist, free_dist = np.asarray(dist), np.asarray(free_dist)
    assert np.all(dist <= np.asarray(radii)[:, None] * (1 + 1e-5))
    assert np.all(free_dist.max(axis=1) > np.asarray(radii))  # unconstrained training leaves every ball
    assert np.all(np.asarray(loss)[:, -1] < np.asarray(loss0) - 0.1)  # and constrained training still learns


def test_composes_with_adam_and_gradient_accumulation():
    # optax 0.2.8's adam and MultiSteps mix int32 counts with floats, which strict promotion refuses;
    # the promotion mode only affects tracing of those optax internals here.
    Xtr, ytr, _, _ = _digits()
    batch = {"x": jnp.asarray(Xtr[:300]), "y": jnp.asarray(ytr[:300])}
    rng = np.random.default_rng(10)
    anchor, r = _lr_params(rng, 0.01), 0.8
    opt = optax.MultiSteps(
        cv.convex_constrained(optax.adam(0.05), mu=0.05, radius=r, learning_rate=0.05), every_k_schedule=2
    )

    def body(carry, _):
        p, s = carry
        u, s = opt.update(jax.grad(_softmax_ce)(p, batch), s, p, anchor=anchor)
        p = optax.apply_updates(p, u)
        return (p, s), (cv.tree_distance(p, anchor), _softmax_ce(p, batch))

    with jax.numpy_dtype_promotion("standard"):
        run = jax.jit(lambda p: jax.lax.scan(body, (p, opt.init(p)), None, length=30)[1])
        dist, loss = run(anchor)
    dist = np.asarray(dist)
    assert np.all(dist <= r * (1 + 1e-5))
    np.testing.assert_allclose(dist[-1], r, rtol=1e-4)  # the constraint binds
    # Accumulation steps (every other one) leave params alone: the prox runs once per real step.
    assert dist[0] == 0.0
    np.testing.assert_array_equal(dist[2::2], dist[1:-1:2])
    assert float(loss[-1]) < float(_softmax_ce(anchor, batch))


def test_learning_rate_resolution_and_errors():
    rng = np.random.default_rng(8)
    params, anchor, grads = _tree(rng), _tree(rng), _tree(rng)

    def one_step(opt, **kw):
        u, _ = jax.jit(functools.partial(opt.update, **kw))(grads, opt.init(params), params, anchor=anchor)
        return _flat(optax.apply_updates(params, u))

    explicit = one_step(cv.convex_constrained(optax.sgd(0.3), mu=2.0, learning_rate=0.3))
    injected = one_step(cv.convex_constrained(optax.inject_hyperparams(optax.sgd)(learning_rate=0.3), mu=2.0))
    v = _flat(params) - 0.3 * _flat(grads)
    np.testing.assert_allclose(explicit, (v + 0.6 * _flat(anchor)) / 1.6, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(injected, explicit, rtol=1e-6, atol=1e-7)
    # Per-call overrides win over the defaults.
    override = one_step(
        cv.convex_constrained(optax.sgd(0.3), mu=5.0, learning_rate=9.0), mu=2.0, learning_rate=0.3
    )
    np.testing.assert_allclose(override, explicit, rtol=1e-6, atol=1e-7)
    # A schedule is read at the count before the step, like optax's own schedules.
    sched = optax.linear_schedule(0.3, 0.1, 2)
    opt = cv.convex_constrained(optax.sgd(sched), mu=2.0, learning_rate=sched)
    p, s = params, opt.init(params)
    ref = _flat(params)
    for k in range(3):
        u, s = opt.update(grads, s, p, anchor=anchor)
        p = optax.apply_updates(p, u)
        lr_k = float(sched(k))
        ref = (ref - lr_k * _flat(grads) + lr_k * 2.0 * _flat(anchor)) / (1 + lr_k * 2.0)
        np.testing.assert_allclose(_flat(p), ref, rtol=1e-5, atol=1e-6)

    no_lr = cv.convex_constrained(optax.sgd(0.1), mu=1.0)
    with pytest.raises(ValueError, match="learning rate"):
        no_lr.update(grads, no_lr.init(params), params, anchor=anchor)
    opt = cv.convex_constrained(optax.sgd(0.1), radius=1.0)
    with pytest.raises(ValueError, match="anchor"):
        opt.update(grads, opt.init(params), params)
    with pytest.raises(ValueError, match="params"):
        opt.update(grads, opt.init(params), anchor=anchor)
    with pytest.raises(ValueError, match="radius"):
        cv.convex_constrained(optax.sgd(0.1), radius=-1.0)
    with pytest.raises(ValueError, match="mu"):
        cv.convex_constrained(optax.sgd(0.1), mu=float("nan"))
    with pytest.raises(ValueError, match="mu"):
        cv.proximal_step(params, anchor, -1.0, 0.1)
    with pytest.raises(TypeError, match="int32"):
        cv.project_l2_ball({"k": jnp.zeros(2, jnp.int32)}, {"k": jnp.zeros(2, jnp.int32)}, 1.0)
    with pytest.raises(ctree.TreeMismatchError, match="anchor"):
        cv.project_l2_ball(params, {"a": anchor["a"]}, 1.0)
    # Off by default: plain inner optimizer, no anchor needed.
    off = cv.convex_constrained(optax.sgd(0.1))
    u, _ = off.update(grads, off.init(params), params)
    np.testing.assert_allclose(_flat(u), -0.1 * _flat(grads), rtol=1e-6)


# ----------------------------------------------------------------------------- loss barriers


def test_barrier_is_zero_for_a_convex_loss():
    Xtr, ytr, Xho, yho = _digits()
    held = {"x": jnp.asarray(Xho), "y": jnp.asarray(yho)}
    rng = np.random.default_rng(9)
    a, b = _lr_params(rng, 0.5), _lr_params(rng, 0.5)
    rep = cv.loss_barrier(_softmax_ce, a, b, held, num_points=9)
    alphas = np.asarray(rep.alphas, np.float64)
    np.testing.assert_allclose(alphas, np.linspace(0, 1, 9), atol=1e-7)
    ref = np.array(
        [
            _np_softmax_ce(
                (1 - al) * np.asarray(a["w"], np.float64) + al * np.asarray(b["w"], np.float64),
                (1 - al) * np.asarray(a["b"], np.float64) + al * np.asarray(b["b"], np.float64),
                Xho,
                yho,
            )[0]
            for al in alphas
        ]
    )
    np.testing.assert_allclose(np.asarray(rep.losses), ref, rtol=2e-5)
    chord = (1 - alphas) * ref[0] + alphas * ref[-1]
    np.testing.assert_allclose(np.asarray(rep.gaps), ref - chord, atol=1e-4)
    assert np.all(np.asarray(rep.gaps)[1:-1] < 0)  # strictly below the chord inside: convex, and not flat
    assert 0.0 <= float(rep.barrier) <= 1e-5

    nodes = ctree.stack([_lr_params(rng, 0.5) for _ in range(3)])
    pair = cv.pairwise_barriers(_softmax_ce, nodes, held, num_points=5)
    anc = cv.anchor_barriers(_softmax_ce, nodes, a, held, num_points=5)
    assert pair.barrier.shape == (3, 3) and anc.barrier.shape == (3,)
    assert np.all(np.abs(np.asarray(pair.barrier)) <= 1e-5) and np.all(
        np.abs(np.asarray(anc.barrier)) <= 1e-5
    )


def _bump(params, batch):
    """(||theta||^2 - 1)^2: zero on the unit sphere, 1 at the origin; not convex."""
    del batch
    sq = jnp.sum(params["x"] ** 2) + jnp.sum(params["y"] ** 2)
    return (sq - 1.0) ** 2


def _unit(i: int, sign: float = 1.0) -> dict:
    v = np.zeros(3, np.float32)
    v[i] = sign
    return {"x": jnp.asarray(v[:1]), "y": jnp.asarray(v[1:])}


def test_barrier_of_a_nonconvex_loss_matches_the_closed_form():
    e1, e2, m1 = _unit(0), _unit(1), _unit(0, -1.0)
    rep = cv.loss_barrier(_bump, e1, e2, None, num_points=11)
    al = np.linspace(0, 1, 11)
    # ||(1-a) e1 + a e2||^2 = (1-a)^2 + a^2, so L = (2a^2 - 2a)^2 = 4 a^2 (1-a)^2; both ends have L = 0.
    np.testing.assert_allclose(np.asarray(rep.losses), 4 * al**2 * (1 - al) ** 2, atol=1e-6)
    np.testing.assert_allclose(float(rep.barrier), 0.25, rtol=1e-6)

    nodes = ctree.stack([e1, e2, m1])
    pair = cv.pairwise_barriers(_bump, nodes, None, num_points=11)
    # e1 -> -e1 passes through the origin: ((1 - 2a)^2 - 1)^2, maximum 1 at a = 1/2.
    expected = np.array([[0.0, 0.25, 1.0], [0.25, 0.0, 0.25], [1.0, 0.25, 0.0]])
    np.testing.assert_allclose(np.asarray(pair.barrier), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pair.losses)[0, 2], ((1 - 2 * al) ** 2 - 1) ** 2, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pair.losses)[2, 0], ((1 - 2 * al) ** 2 - 1) ** 2, atol=1e-6)
    np.testing.assert_allclose(float(pair.barrier[0, 1]), float(rep.barrier), atol=1e-7)

    origin = {"x": jnp.zeros((1,), jnp.float32), "y": jnp.zeros((2,), jnp.float32)}
    anc = cv.anchor_barriers(_bump, nodes, origin, None, num_points=11)
    # From the origin (L = 1) to a unit node (L = 0): L = (a^2 - 1)^2 against the chord 1 - a.
    gap = (al**2 - 1) ** 2 - (1 - al)
    np.testing.assert_allclose(np.asarray(anc.gaps), np.broadcast_to(gap, (3, 11)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(anc.barrier), np.full(3, gap.max()), atol=1e-6)


def test_barrier_accepts_unhashable_loss_and_validates():
    class Loss:
        __hash__ = None  # e.g. a mutable dataclass holding data

        def __call__(self, params, batch):
            return _bump(params, batch)

    rep = cv.loss_barrier(Loss(), _unit(0), _unit(1), None, num_points=3)
    np.testing.assert_allclose(np.asarray(rep.losses), [0.0, 0.25, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="num_points"):
        cv.loss_barrier(_bump, _unit(0), _unit(1), None, num_points=1)
    with pytest.raises(ctree.TreeMismatchError):
        cv.anchor_barriers(_bump, ctree.stack([_unit(0)]), {"x": jnp.zeros((1,), jnp.float32)}, None)
