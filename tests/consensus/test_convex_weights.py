"""Convex merge weights against independent float64 references (scipy SLSQP, KKT, closed forms)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from consensus.convex import problems
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import project_capped_simplex, weight_bounds
from consensus.convex.qp import ConvexWeights, solve_qp_weights
from consensus.convex.weights import anchor_weights, quadratic_statistics, quadratic_weights

# ----------------------------------------------------------------------------- references


def slsqp_simplex(fun, jac, lb, ub):
    """Minimise fun over {sum w = 1, lb <= w <= ub} with scipy SLSQP (float64)."""
    n = lb.shape[0]
    free = ub > 0
    res = optimize.minimize(
        fun,
        free / free.sum(),
        jac=jac,
        method="SLSQP",
        bounds=list(zip(lb, ub, strict=True)),
        constraints=[{"type": "eq", "fun": lambda w: np.sum(w) - 1.0, "jac": lambda w: np.ones(n)}],
        options={"ftol": 1e-15, "maxiter": 2000},
    )
    assert res.success, res.message
    return res.x, float(res.fun)


def kkt_violation(grad, w, lb, ub, tol_active=1e-5):
    """How far (w, grad) is from the KKT conditions of min f over the capped simplex.

    At an optimum some nu has g_i + nu = 0 where lb_i < w_i < ub_i, >= 0 at the
    lower bound and <= 0 at the upper bound: the interval [lo, hi] of admissible
    nu is non-empty. Returns max(0, lo - hi).
    """
    fixed = ub - lb < 1e-12
    at_lb = (w <= lb + tol_active) & ~fixed
    at_ub = (w >= ub - tol_active) & ~fixed & ~at_lb
    free = ~fixed & ~at_lb & ~at_ub
    lo = np.max(-grad[at_lb | free], initial=-np.inf)
    hi = np.min(-grad[at_ub | free], initial=np.inf)
    return max(0.0, lo - hi)


def assert_feasible(w, lb, ub, atol=1e-9):
    assert np.all(np.isfinite(w))
    assert abs(w.sum() - 1.0) < atol
    assert np.all(w >= lb - atol) and np.all(w <= ub + atol)


SHAPES = [(6, 4), (5,)]  # one set of leaf shapes for every tree test: kernels compile once


def random_stacked(seed, n, shapes=SHAPES, scale=0.1):
    """(stacked, ref): n nodes scattered around a random reference, float32 trees."""
    rng = np.random.default_rng(seed)
    ref = {f"p{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    stacked = {
        k: v[None] + jnp.asarray(scale * rng.normal(size=(n, *v.shape)), jnp.float32) for k, v in ref.items()
    }
    return stacked, ref


def like(ref, seed, fn=lambda a: a):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(fn(rng.normal(size=v.shape)), jnp.float32) for k, v in ref.items()}


def flat_nodes(stacked) -> np.ndarray:
    leaves = jax.tree_util.tree_leaves(stacked)
    n = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(n, -1) for x in leaves], axis=1)


def flat(t) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree_util.tree_leaves(t)])


# ----------------------------------------------------------------------------- QP core


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qp_matches_slsqp_and_kkt(seed):
    rng = np.random.default_rng(seed)
    n = 7
    a = rng.normal(size=(n, 3))  # rank-deficient PSD: the ridge makes it strictly convex
    qm = a @ a.T
    q = rng.normal(size=n)
    lam, cap, floor = 0.05, 0.4, 0.02
    mask = np.ones(n, bool)
    mask[seed % n] = False
    res = solve_qp_weights(qm, q, 0.7, lambda_reg=lam, max_weight=cap, min_weight=floor, mask=mask)
    acc = mask
    lb, ub = floor * acc, cap * acc
    u = acc / acc.sum()

    def fun(w):
        return 0.5 * w @ qm @ w + q @ w + 0.7 + lam * np.sum((w - u) ** 2)

    def jac(w):
        return qm @ w + q + 2 * lam * (w - u)

    w_ref, f_ref = slsqp_simplex(fun, jac, lb, ub)
    assert not res.fallback and res.status == "optimal"
    assert_feasible(res.weights, lb, ub)
    assert res.weights[~acc].tolist() == [0.0]
    np.testing.assert_allclose(res.weights, w_ref, atol=2e-5)
    assert res.objective == pytest.approx(fun(res.weights), rel=1e-12)
    assert res.objective <= f_ref + 1e-7
    assert kkt_violation(jac(res.weights)[acc], res.weights[acc], lb[acc], ub[acc]) < 1e-5


def test_qp_caps_bind_and_uniform_when_cap_is_one_over_k():
    n = 5
    q = np.array([-1.0, 0.0, 0.0, 0.0, 0.0])  # node 0 alone is best: a vertex without caps
    res = solve_qp_weights(np.zeros((n, n)), q)
    np.testing.assert_allclose(res.weights, [1, 0, 0, 0, 0], atol=1e-6)
    capped = solve_qp_weights(np.zeros((n, n)), q, max_weight=0.3)
    assert capped.weights[0] == pytest.approx(0.3, abs=1e-7)
    assert np.all(capped.weights <= 0.3 + 1e-12)
    # cap = 1/(n - f) with n - f accepted nodes: the uniform weights are the only point.
    mask = np.array([True, True, False, True, True])
    only = solve_qp_weights(np.zeros((n, n)), q, max_weight=1 / 4, mask=mask)
    np.testing.assert_allclose(only.weights, [0.25, 0.25, 0, 0.25, 0.25], atol=1e-12)


def test_infeasible_options_raise_before_solving(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("solver must not be called for infeasible options")

    monkeypatch.setattr(problems, "solve", boom)
    q = np.zeros(4)
    with pytest.raises(ValueError, match=r"max_weight=0.2 is infeasible with 4 accepted nodes.*1/4 = 0.25"):
        solve_qp_weights(np.eye(4), q, max_weight=0.2)
    with pytest.raises(ValueError, match="3 accepted nodes"):
        solve_qp_weights(np.eye(4), q, max_weight=0.3, mask=np.array([True, True, True, False]))
    with pytest.raises(ValueError, match="all 4 nodes are rejected"):
        solve_qp_weights(np.eye(4), q, mask=np.zeros(4, bool))
    with pytest.raises(ValueError, match="min_weight=0.3 is infeasible"):
        solve_qp_weights(np.eye(4), q, min_weight=0.3)
    with pytest.raises(ValueError, match="lambda_reg"):
        solve_qp_weights(np.eye(4), q, lambda_reg=-1.0)
    with pytest.raises(ValueError, match="max_weight must be in"):
        solve_qp_weights(np.eye(4), q, max_weight=1.5)
    with pytest.raises(TypeError, match="boolean"):
        solve_qp_weights(np.eye(4), q, mask=np.ones(4))
    with pytest.raises(ValueError, match="not installed"):
        solve_qp_weights(np.eye(4), q, solver="NO_SUCH_SOLVER")


def test_projection_satisfies_kkt():
    rng = np.random.default_rng(3)
    for _ in range(5):
        v = rng.normal(size=7) * 2
        lb = rng.uniform(0.0, 0.1, size=7)
        ub = rng.uniform(0.2, 0.6, size=7)
        ub[2] = lb[2] = 0.0  # a rejected node
        w = project_capped_simplex(v, lb, ub)
        assert_feasible(w, lb, ub, atol=1e-12)
        # 1/2 ||w - v||^2 is strictly convex: the KKT conditions certify the unique projection.
        assert kkt_violation(w - v, w, lb, ub, tol_active=1e-12) < 1e-12


def test_weight_bounds_snap_cap_equal_to_one_over_k():
    acc = np.array([True] * 3 + [False])
    lb, ub = weight_bounds(acc, max_weight=1 / 3 - 1e-12)
    assert ub[:3].sum() >= 1.0 and ub[3] == 0.0 and lb.sum() == 0.0


# ----------------------------------------------------------------------------- quadratic model on trees


def test_quadratic_statistics_match_flattened_float64():
    stacked, ref = random_stacked(0, 6, [(5, 3), (4,), (2, 2, 2)])
    g, h = like(ref, 1), like(ref, 2, np.abs)
    qm, q = quadratic_statistics(stacked, ref, g, h)
    d = flat_nodes(stacked) - flat(ref)[None]
    np.testing.assert_allclose(qm, (d * flat(h)) @ d.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(q, d @ flat(g), rtol=1e-5, atol=1e-6)


def test_quadratic_weights_minimize_the_model_and_reject_nodes():
    n = 6
    stacked, ref = random_stacked(4, n)
    # A node holding NaN is rejected automatically; node 1 is rejected by the vote.
    stacked = {k: v.at[3].set(jnp.nan) if k == "p0" else v for k, v in stacked.items()}
    g, h = like(ref, 5), like(ref, 6, lambda a: 0.5 + np.abs(a))
    mask = np.array([True, False, True, True, True, True])
    res = quadratic_weights(stacked, ref, g, h, loss=1.25, max_weight=0.5, mask=mask)
    assert res.accepted.tolist() == [True, False, True, False, True, True]
    assert res.weights[1] == 0.0 and res.weights[3] == 0.0
    acc = res.accepted
    x = flat_nodes(stacked)[acc]
    d = x - flat(ref)[None]
    qm, q = (d * flat(h)) @ d.T, d @ flat(g)
    lb, ub = np.zeros(acc.sum()), np.full(acc.sum(), 0.5)
    w_ref, f_ref = slsqp_simplex(lambda w: 0.5 * w @ qm @ w + q @ w, lambda w: qm @ w + q, lb, ub)
    np.testing.assert_allclose(res.weights[acc], w_ref, atol=1e-4)
    assert res.objective == pytest.approx(1.25 + f_ref, abs=1e-6)


def test_quadratic_weights_exact_for_a_quadratic_loss():
    # L(theta) = 1/2 sum h (theta - t)^2 is its own quadratic model: the weights must
    # minimize the true loss of the merge, checked by scipy on the true loss.
    n = 6
    stacked, ref = random_stacked(7, n, scale=1.0)
    target = jax.tree.map(lambda r: r + 0.3, ref)
    h = jax.tree.map(lambda r: jnp.full(r.shape, 2.0, jnp.float32), ref)
    g = jax.tree.map(lambda r, t, hh: hh * (r - t), ref, target, h)
    loss0 = float(
        sum(
            jnp.sum(0.5 * hh * (r - t) ** 2)
            for r, t, hh in zip(*map(jax.tree.leaves, (ref, target, h)), strict=True)
        )
    )
    res = quadratic_weights(stacked, ref, g, h, loss=loss0)
    x, t = flat_nodes(stacked), flat(target)

    def true_loss(w):
        return float(np.sum((w @ x - t) ** 2))

    _, f_ref = slsqp_simplex(true_loss, lambda w: 2 * x @ (w @ x - t), np.zeros(n), np.ones(n))
    assert res.objective == pytest.approx(true_loss(res.weights), rel=1e-5)
    assert res.objective == pytest.approx(f_ref, rel=1e-5)


def test_quadratic_weights_input_errors():
    stacked, ref = random_stacked(0, 6)
    g = jax.tree.map(jnp.zeros_like, ref)
    with pytest.raises(ValueError, match="curvature must be >= 0"):
        quadratic_weights(stacked, ref, g, jax.tree.map(lambda r: -jnp.ones_like(r), ref))
    with pytest.raises(ValueError, match="grad, leaf .* NaN"):
        quadratic_weights(stacked, ref, jax.tree.map(lambda r: r * jnp.nan, ref), g)
    with pytest.raises(Exception, match="shape"):
        quadratic_weights(stacked, ref, {"p0": jnp.zeros((5,), jnp.float32), "p1": g["p1"]}, g)


# ----------------------------------------------------------------------------- anchor


def test_anchor_tree_matches_scipy_projection():
    n = 6
    stacked, ref = random_stacked(8, n)
    anchor = jax.tree.map(lambda r: r + 0.02, ref)
    res = anchor_weights(stacked, anchor, max_weight=0.3)
    x, a = flat_nodes(stacked), flat(anchor)
    lb, ub = np.zeros(n), np.full(n, 0.3)
    w_ref, f_ref = slsqp_simplex(
        lambda w: float(np.sum((w @ x - a) ** 2)), lambda w: 2 * x @ (w @ x - a), lb, ub
    )
    assert_feasible(res.weights, lb, ub)
    assert res.objective == pytest.approx(f_ref, rel=1e-4, abs=1e-8)
    np.testing.assert_allclose(res.weights, w_ref, atol=1e-3)


def test_anchor_node_weights_recover_v_and_respect_caps():
    n = 6
    stacked, _ = random_stacked(9, n)
    v = np.array([0.5, 0.3, 0.1, 0.1, 0.0, 0.0])
    res = anchor_weights(stacked, anchor_node_weights=v)
    np.testing.assert_allclose(res.weights, v, atol=1e-5)
    assert res.objective == pytest.approx(0.0, abs=1e-8)
    capped = anchor_weights(stacked, anchor_node_weights=v, max_weight=0.35)
    x = flat_nodes(stacked)
    a = v @ x
    lb, ub = np.zeros(n), np.full(n, 0.35)
    _, f_ref = slsqp_simplex(lambda w: float(np.sum((w @ x - a) ** 2)), lambda w: 2 * x @ (w @ x - a), lb, ub)
    assert capped.objective == pytest.approx(f_ref, rel=1e-4)
    assert np.all(capped.weights <= 0.35 + 1e-12)
    with pytest.raises(ValueError, match="exactly one"):
        anchor_weights(stacked)
    with pytest.raises(ValueError, match="rejected nodes"):
        anchor_weights(stacked, anchor_node_weights=v, mask=np.array([False] + [True] * 5))


# ----------------------------------------------------------------------------- mixture NLL


def random_probs(rng, n, m):
    return rng.dirichlet(np.full(5, 0.7), size=(n, m))[..., 0]


@pytest.mark.parametrize("method", ["conic", "newton"])
def test_mixture_nll_matches_slsqp_and_kkt(method):
    rng = np.random.default_rng(11)
    n, m = 6, 300
    p = random_probs(rng, n, m)
    mask = np.array([True, True, True, True, False, True])
    res = mixture_nll_weights(p, 0.01, 0.45, mask, min_weight=0.01, method=method)
    u = mask / mask.sum()
    lb, ub = 0.01 * mask, 0.45 * mask

    def fun(w):
        return float(-np.mean(np.log(np.maximum(w @ p, 1e-300))) + 0.01 * np.sum((w - u) ** 2))

    def jac(w):
        return -(p / (w @ p)[None]).mean(axis=1) + 0.02 * (w - u)

    w_ref, f_ref = slsqp_simplex(fun, jac, lb, ub)
    assert not res.fallback and res.status == "optimal"
    assert_feasible(res.weights, lb, ub)
    assert res.weights[4] == 0.0
    assert res.objective == pytest.approx(fun(res.weights), rel=1e-12)
    assert res.objective <= f_ref + 1e-8
    np.testing.assert_allclose(res.weights, w_ref, atol=1e-4)
    # Clarabel's default tolerances on the exponential cones leave ~1e-5 in the gradient.
    kkt_tol = 1e-4 if method == "conic" else 1e-7
    assert kkt_violation(jac(res.weights)[mask], res.weights[mask], lb[mask], ub[mask]) < kkt_tol


def test_mixture_nll_dominant_node_closed_form():
    # Node 0 gives the true label at least the probability any other node gives,
    # on every example: sum_i w_i p_ij <= p_0j, so w = e_0 is optimal; with a cap
    # c the gradient of node 0 is the most negative everywhere, so w_0 = c.
    rng = np.random.default_rng(12)
    n, m = 5, 200
    others = rng.uniform(0.05, 0.6, size=(n - 1, m))
    best = np.max(others, axis=0) + rng.uniform(0.0, 0.3, size=m)
    p = np.vstack([best, others])
    for method in ("conic", "newton"):
        res = mixture_nll_weights(p, method=method)
        np.testing.assert_allclose(res.weights, np.eye(n)[0], atol=1e-6)
        assert res.objective == pytest.approx(-np.mean(np.log(best)), rel=1e-6)
        capped = mixture_nll_weights(p, max_weight=0.6, method=method)
        assert capped.weights[0] == pytest.approx(0.6, abs=1e-7)


def test_mixture_nll_floor_and_input_errors():
    p = np.array([[0.0, 0.5, 0.9], [0.8, 0.0, 0.1]])
    res = mixture_nll_weights(p)  # zeros are floored at 1e-12, the objective stays finite
    assert np.isfinite(res.objective) and not res.fallback
    with pytest.raises(ValueError, match="probabilities in"):
        mixture_nll_weights(p * 3)
    with pytest.raises(ValueError, match=r"\(n nodes, m examples\)"):
        mixture_nll_weights(np.ones(3))
    # A node with NaN probabilities is rejected, not propagated.
    pn = np.vstack([p, np.full((1, 3), np.nan)])
    out = mixture_nll_weights(pn)
    assert out.accepted.tolist() == [True, True, False] and out.weights[2] == 0.0


def test_newton_and_conic_agree_on_larger_instance():
    rng = np.random.default_rng(13)
    p = random_probs(rng, 8, 400)
    a = mixture_nll_weights(p, max_weight=0.3, method="conic")
    b = mixture_nll_weights(p, max_weight=0.3, method="newton")
    assert a.objective == pytest.approx(b.objective, abs=1e-8)
    np.testing.assert_allclose(a.weights, b.weights, atol=5e-4)
    assert b.iterations >= 2


def test_result_has_no_nan_and_same_type_for_every_objective():
    stacked, ref = random_stacked(0, 6)
    g = jax.tree.map(jnp.ones_like, ref)
    outs = [
        quadratic_weights(stacked, ref, g, g),
        anchor_weights(stacked, ref),
        mixture_nll_weights(np.full((6, 5), 0.5)),
    ]
    for r in outs:
        assert isinstance(r, ConvexWeights)
        assert np.all(np.isfinite(r.weights)) and r.solve_time > 0 and isinstance(r.status, str)
    assert [r.objective_name for r in outs] == ["quadratic", "anchor", "mixture_nll"]


# ----------------------------------------------------------------------------- trust region


def quadratic_task(seed, n=6):
    """Nodes, the target t and curvature h of the true loss L = 1/2 sum h (theta - t)^2 (float64)."""
    stacked, ref = random_stacked(seed, n, scale=1.0)
    target = {k: v + 0.3 for k, v in ref.items()}
    h = like(ref, seed + 1, lambda a: 0.5 + np.abs(a))

    def true_loss(p):
        return float(0.5 * np.sum(flat(h) * (flat(p) - flat(target)) ** 2))

    return stacked, target, h, true_loss


def test_trust_region_rejects_an_overconfident_model():
    from consensus import tree
    from consensus.convex.weights import trust_region_quadratic_weights

    n = 6
    stacked, target, h, true_loss = quadratic_task(20, n)
    mean = tree.weighted_sum(stacked, jnp.full((n,), 1 / n, jnp.float32))
    # Exact gradient at the mean, but curvature underestimated 100x: the model overshoots.
    g_mean = {k: h[k] * (mean[k] - target[k]) for k in mean}
    weak = {k: v / 100.0 for k, v in h.items()}
    plain = quadratic_weights(stacked, mean, g_mean, weak)

    def merge(w):
        return tree.weighted_sum(stacked, jnp.asarray(w, jnp.float32))

    u = np.full(n, 1 / n)
    assert true_loss(merge(plain.weights)) > true_loss(merge(u))  # the untrusted step is harmful
    res = trust_region_quadratic_weights(stacked, mean, g_mean, weak, true_loss)
    assert res.iterations > 1 and "accepted lambda" in res.message
    assert true_loss(merge(res.weights)) < true_loss(merge(u))
    # rho >= eta, recomputed from flattened float64 statistics.
    d = flat_nodes(stacked) - flat(mean)[None]
    qm, q = (d * flat(weak)) @ d.T, d @ flat(g_mean)

    def model(w):
        return q @ w + 0.5 * w @ qm @ w

    rho = (true_loss(merge(u)) - true_loss(merge(res.weights))) / (model(u) - model(res.weights))
    assert rho >= 0.1 - 1e-6


def test_trust_region_returns_uniform_when_no_step_is_good():
    from consensus import tree
    from consensus.convex.weights import trust_region_quadratic_weights

    n = 6
    stacked, target, h, _ = quadratic_task(21, n)
    mean = tree.weighted_sum(stacked, jnp.full((n,), 1 / n, jnp.float32))
    m_flat = flat(mean)

    def spiky_loss(p):  # any move away from the uniform merge costs more than the model promises
        return 1.0 + 1e3 * float(np.sum((flat(p) - m_flat) ** 2)) ** 0.25

    grad = {k: h[k] * (mean[k] - target[k]) for k in mean}
    res = trust_region_quadratic_weights(stacked, mean, grad, h, spiky_loss, max_steps=3)
    np.testing.assert_allclose(res.weights, np.full(n, 1 / n))
    assert res.iterations == 4 and "uniform weights" in res.message and not res.fallback


def test_indefinite_q_is_refused():
    with pytest.raises(ValueError, match="not positive semi-definite"):
        solve_qp_weights(np.diag([1.0, -0.5, 1.0]), np.zeros(3))
