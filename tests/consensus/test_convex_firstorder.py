"""The capped simplex's linear minimizer, projection and duality gap, and the certified mixture-NLL solver.

References: scipy's linprog (the linear minimizer), a float64 bisection (the projection),
cvxpy's exponential-cone solve at tight tolerances (the mixture NLL's optimum).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize

from consensus.convex import firstorder
from consensus.convex.firstorder import accelerated_projected_gradient, frank_wolfe_gap, linear_minimizer
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import ProblemCache, project_capped_simplex, weight_bounds

TIGHT = {"tol_gap_abs": 1e-12, "tol_gap_rel": 1e-12, "tol_feas": 1e-12, "warm_start": False}


def random_bounds(rng, n):
    acc = rng.random(n) < 0.8
    acc[:3] = True
    cap = rng.uniform(1.0 / acc.sum(), 1.0)
    floor = rng.uniform(0.0, 1.0 / acc.sum()) * (rng.random() < 0.5)
    return weight_bounds(acc, cap, floor)


def bisection_projection(v, lb, ub):
    lo, hi = float(np.min(v - ub)) - 1.0, float(np.max(v - lb)) + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.clip(v - mid, lb, ub).sum() > 1.0 else (lo, mid)
    return np.clip(v - 0.5 * (lo + hi), lb, ub)


@pytest.mark.parametrize("seed", range(4))
def test_linear_minimizer_and_projection_match_references(seed):
    rng = np.random.default_rng(seed)
    n = 12
    lb, ub = random_bounds(rng, n)
    g = rng.normal(size=n)
    g[3] = g[4]  # a tie
    s = linear_minimizer(g, lb, ub)
    ref = optimize.linprog(g, A_eq=np.ones((1, n)), b_eq=[1.0], bounds=list(zip(lb, ub, strict=True)))
    assert ref.status == 0
    assert g @ s == pytest.approx(ref.fun, abs=1e-12)
    assert abs(s.sum() - 1.0) < 1e-12 and np.all(s >= lb) and np.all(s <= ub)
    for scale in (0.01, 1.0, 100.0):
        v = scale * rng.normal(size=n)
        np.testing.assert_allclose(
            project_capped_simplex(v, lb, ub), bisection_projection(v, lb, ub), atol=1e-12
        )


def mixture_instance(seed, n, m, lam=0.0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(5, 0.7), size=(n, m))[..., 0]
    p[0] = np.clip(p[0] + 0.3, 0.0, 1.0)  # one better node, so that a cap binds

    def f(w):
        return float(-np.mean(np.log(w @ p)) + lam * np.sum((w - 1.0 / n) ** 2))

    def grad(w):
        return -(p / (w @ p)[None]).mean(axis=1) + 2.0 * lam * (w - 1.0 / n)

    return p, f, grad


@pytest.mark.parametrize("seed", range(3))
def test_the_gap_bounds_the_distance_to_cvxpys_optimum(seed):
    """For feasible points far from and near the optimum (random ones, first-order iterates), the
    reported gap is >= f(w) - f*, with f* from cvxpy at tight tolerances."""
    n, m = 7, 120
    p, f, grad = mixture_instance(seed, n, m, lam=0.02)
    lb, ub = weight_bounds(np.ones(n, bool), 0.35, 0.01)
    ref = mixture_nll_weights(p, 0.02, 0.35, min_weight=0.01, method="conic", solver_options=TIGHT)
    f_star = f(ref.weights)
    rng = np.random.default_rng(seed)
    points = [project_capped_simplex(rng.dirichlet(np.ones(n) * a), lb, ub) for a in (0.1, 1.0, 10.0)]
    for iters in (1, 3, 10, 30):
        fo = accelerated_projected_gradient(
            f, lambda w: (f(w), grad(w)), np.full(n, 1.0 / n), lb, ub, gap_tol=0.0, max_iter=iters
        )
        assert fo.gap == pytest.approx(frank_wolfe_gap(grad(fo.weights), fo.weights, lb, ub))
        points.append(fo.weights)
    for w in points:
        gap = frank_wolfe_gap(grad(w), w, lb, ub)
        assert f(w) - f_star <= gap + 1e-10
        # Not vacuous: the gap shrinks with the distance to the optimum.
        assert gap <= 10 * np.linalg.norm(w - ref.weights) * np.abs(grad(w)).max() + 1e-9
    assert frank_wolfe_gap(grad(ref.weights), ref.weights, lb, ub) < 1e-6


@pytest.mark.parametrize(
    ("lam", "cap", "floor"), [(0.0, None, 0.0), (0.0, 0.3, 0.0), (0.05, 0.4, 0.02), (0.0, 0.25, 0.05)]
)
def test_certified_newton_matches_cvxpy(lam, cap, floor):
    n, m = 8, 200
    p, f, _ = mixture_instance(5, n, m, lam)
    mask = np.ones(n, bool)
    mask[6] = False
    ref = mixture_nll_weights(p, lam, cap, mask, min_weight=floor, method="conic", solver_options=TIGHT)
    res = mixture_nll_weights(p, lam, cap, mask, min_weight=floor, method="newton", cache=ProblemCache())
    assert res.status == "optimal" and not res.fallback and res.message == ""
    assert res.gap <= 1e-9
    assert res.weights[6] == 0.0
    np.testing.assert_allclose(res.weights, ref.weights, atol=1e-6)
    assert res.objective <= ref.objective + 1e-10


def test_many_nodes_few_examples_is_certified_without_cvxpy(monkeypatch):
    """The cross-device shape (n > m: a singular Hessian, a sparse optimum): certified by the gap
    and equal in objective to cvxpy's conic solve, with no cvxpy problem built."""
    n, m = 120, 40
    p, f, grad = mixture_instance(9, n, m)
    cache = ProblemCache()
    res = mixture_nll_weights(p, max_weight=0.4, method="newton", cache=cache)
    assert len(cache) == 0 and res.status == "optimal" and res.gap <= 1e-9
    ref = mixture_nll_weights(p, max_weight=0.4, method="conic", solver_options=TIGHT)
    assert abs(res.objective - ref.objective) <= 1e-8
    assert res.objective <= ref.objective + res.gap
    assert 0 < np.count_nonzero(res.weights) < n


def test_an_uncertified_newton_point_goes_to_cvxpy():
    p, _, _ = mixture_instance(3, 6, 80)
    # Fresh caches: both conic solves start cold, so they give the same point.
    res = mixture_nll_weights(
        p, max_weight=0.5, method="newton", warm_iter=0, max_iter=1, cache=ProblemCache()
    )
    ref = mixture_nll_weights(p, max_weight=0.5, method="conic", cache=ProblemCache())
    assert "above gap_tol" in res.message and "kept cvxpy's point" in res.message
    np.testing.assert_array_equal(res.weights, ref.weights)
    assert res.gap == ref.gap


def test_first_order_options_are_checked():
    with pytest.raises(ValueError, match="gap_tol"):
        mixture_nll_weights(np.full((3, 4), 0.5), gap_tol=0.0)
    with pytest.raises(ValueError, match="warm_iter"):
        mixture_nll_weights(np.full((3, 4), 0.5), warm_iter=-1)
    with pytest.raises(ValueError, match="check_every"):
        firstorder.accelerated_projected_gradient(
            lambda w: 0.0, lambda w: (0.0, w), np.ones(2) / 2, np.zeros(2), np.ones(2), check_every=0
        )
