"""Compiled cvxpy problems: DPP, caching, re-solve == fresh build, solver choice, fallback."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest

from consensus.convex import mixture, problems
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import ProblemCache, ProblemKey
from consensus.convex.qp import solve_qp_weights


def random_qp(seed, n):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    return a @ a.T / n, rng.normal(size=n)


def random_probs(seed, n, m):
    return np.random.default_rng(seed).uniform(0.01, 1.0, size=(n, m))


def test_every_problem_is_dpp_and_cached_by_options():
    cache = ProblemCache()
    qm, q = random_qp(0, 5)
    solve_qp_weights(qm, q, cache=cache)
    solve_qp_weights(qm, q, lambda_reg=0.1, min_weight=0.05, cache=cache)
    mixture_nll_weights(random_probs(0, 5, 40), cache=cache, method="conic")
    mixture_nll_weights(random_probs(0, 5, 40), 0.1, 0.5, cache=cache, min_weight=0.01, method="conic")
    keys = cache.keys()
    assert set(keys) == {
        ProblemKey("qp", 5, 0, "CLARABEL", False, False),
        ProblemKey("qp", 5, 0, "CLARABEL", True, True),
        ProblemKey("mixture_nll", 5, 40, "CLARABEL", False, False),
        ProblemKey("mixture_nll", 5, 40, "CLARABEL", True, True),
    }
    for key in keys:
        assert cache[key].problem.is_dpp(), key
        assert all(isinstance(p, cp.Parameter) for p in cache[key].problem.parameters())


@pytest.mark.parametrize("form", ["qp", "mixture_nll"])
def test_resolve_matches_fresh_build(form):
    """Round 2 through Parameters gives what a freshly built problem gives."""
    shared = ProblemCache()
    n, m = 6, 50

    def run(seed, cache):
        mask = np.ones(n, bool)
        mask[seed % n] = False
        if form == "qp":
            qm, q = random_qp(seed, n)
            return solve_qp_weights(qm, q, lambda_reg=0.05, max_weight=0.4, mask=mask, cache=cache)
        return mixture_nll_weights(random_probs(seed, n, m), 0.05, 0.4, mask, method="conic", cache=cache)

    first = run(1, shared)
    again = run(2, shared)  # different data and mask, same compiled problem
    fresh = run(2, ProblemCache())
    assert first.built and not again.built and fresh.built
    (key,) = shared.keys()
    assert shared[key].solves == 2
    # The QP answer is polished to an exact KKT point; the exponential-cone one is
    # an interior-point answer at Clarabel's default tolerance.
    atol = 1e-9 if form == "qp" else 5e-5
    np.testing.assert_allclose(again.weights, fresh.weights, atol=atol)
    assert again.objective == pytest.approx(fresh.objective, rel=1e-8)
    assert again.weights[2] == 0.0


def test_other_installed_solver_gives_the_same_weights():
    qm, q = random_qp(3, 6)
    a = solve_qp_weights(qm, q, lambda_reg=0.01, max_weight=0.5, cache=ProblemCache())
    b = solve_qp_weights(
        qm,
        q,
        lambda_reg=0.01,
        max_weight=0.5,
        solver="scs",
        cache=ProblemCache(),
        solver_options={"eps_abs": 1e-9, "eps_rel": 1e-9},
    )
    assert b.solver == "SCS"
    np.testing.assert_allclose(a.weights, b.weights, atol=1e-4)


def test_solver_exception_falls_back_to_uniform_and_says_why(monkeypatch):
    cache = ProblemCache()
    qm, q = random_qp(4, 5)
    solve_qp_weights(qm, q, cache=cache)  # build it
    (key,) = cache.keys()

    def boom(*args, **kwargs):
        raise cp.error.SolverError("simulated numerical trouble")

    monkeypatch.setattr(cache[key].problem, "solve", boom)
    mask = np.array([True, True, False, True, True])
    res = solve_qp_weights(qm, q, mask=mask, cache=cache)
    assert res.fallback and res.status == "solver_error"
    assert "simulated numerical trouble" in res.message and "uniform" in res.message
    np.testing.assert_array_equal(res.weights, [0.25, 0.25, 0.0, 0.25, 0.25])
    assert np.isfinite(res.objective)


@pytest.mark.parametrize("status", ["infeasible", "unbounded", "solver_error"])
def test_bad_status_or_nan_point_falls_back(monkeypatch, status):
    cache = ProblemCache()
    p = random_probs(5, 4, 30)
    mixture_nll_weights(p, cache=cache, method="conic")
    (key,) = cache.keys()
    compiled = cache[key]

    def fake_solve(*args, **kwargs):
        compiled.w.save_value(np.full(4, np.nan))  # bypasses cvxpy's NaN check, as a solver's output
        compiled.problem._status = status  # what cvxpy's solve sets
        return float("nan")

    monkeypatch.setattr(compiled.problem, "solve", fake_solve)
    res = mixture_nll_weights(p, cache=cache, method="conic")
    assert res.fallback and status in res.message
    np.testing.assert_array_equal(res.weights, np.full(4, 0.25))


def test_nan_point_with_optimal_status_falls_back(monkeypatch):
    cache = ProblemCache()
    qm, q = random_qp(6, 4)
    solve_qp_weights(qm, q, cache=cache)
    compiled = cache[cache.keys()[0]]

    def fake_solve(*args, **kwargs):
        compiled.w.save_value(np.array([np.nan, 0.5, 0.5, 0.0]))
        compiled.problem._status = "optimal"
        return 0.0

    monkeypatch.setattr(compiled.problem, "solve", fake_solve)
    res = solve_qp_weights(qm, q, cache=cache)
    assert res.fallback and "non-finite" in res.message
    assert np.all(np.isfinite(res.weights))


def test_newton_falls_back_to_cvxpy_then_to_uniform(monkeypatch):
    p = random_probs(7, 4, 30)
    real_solve = problems.solve

    def failing(kinds):
        def solve(compiled, values, **kwargs):
            if compiled.key.objective in kinds:
                return problems.SolveOutcome(
                    None, float("nan"), "solver_error", 0.0, "solver raised: step failed"
                )
            return real_solve(compiled, values, **kwargs)

        return solve

    # The KKT-certified active-set step would solve this small QP without the solver: decline it,
    # so every Newton step goes to cvxpy's QP, which fails; the conic form then solves the problem.
    monkeypatch.setattr(mixture, "_kkt_step", lambda *a: None)
    monkeypatch.setattr(problems, "solve", failing({"qp"}))
    res = mixture_nll_weights(p, cache=ProblemCache(), method="newton")
    conic = mixture_nll_weights(p, cache=ProblemCache(), method="conic")
    assert not res.fallback and "Newton step 1" in res.message and "kept cvxpy's point" in res.message
    np.testing.assert_array_equal(res.weights, conic.weights)
    # Both fail: the uniform fallback, with both reasons.
    monkeypatch.setattr(problems, "solve", failing({"qp", "mixture_nll"}))
    res = mixture_nll_weights(p, cache=ProblemCache(), method="newton")
    assert res.fallback and "Newton step 1" in res.message and res.message.count("step failed") == 2
    np.testing.assert_array_equal(res.weights, np.full(4, 0.25))


def test_cache_evicts_least_recently_used():
    cache = ProblemCache(maxsize=2)
    for n in (3, 4, 5):
        qm, q = random_qp(n, n)
        solve_qp_weights(qm, q, cache=cache)
    assert [k.n for k in cache.keys()]  # noqa: SIM118 - keys() is the API under test == [4, 5]
    with pytest.raises(ValueError, match="unknown problem form"):
        problems.get_problem("lp", 3, cache=cache)


@pytest.mark.parametrize("seed", range(8))
def test_active_set_newton_step_equals_the_cvxpy_qp(seed):
    """The Newton step's QP over the capped simplex, solved by the active-set method, equals
    cvxpy's solution (written here from scratch) when it answers, and it answers for well-posed
    QPs with bounds active at the optimum; rejected nodes (ub = 0) stay at 0."""
    rng = np.random.default_rng(seed)
    n = 7
    a = rng.normal(size=(n, n + 3))
    h = a @ a.T / n + 1e-3 * np.eye(n)
    lin = 2.0 * rng.normal(size=n)  # large enough that some weights hit 0 or the cap
    lb = np.zeros(n)
    ub = np.full(n, 0.35)
    ub[seed % n] = 0.0  # a rejected node
    w0 = np.where(ub > 0, 1.0 / (ub > 0).sum(), 0.0)
    got = mixture._kkt_step(h, lin, w0, lb, ub)
    assert got is not None
    v = cp.Variable(n)
    cp.Problem(cp.Minimize(0.5 * cp.quad_form(v, h) + lin @ v), [cp.sum(v) == 1, v >= lb, v <= ub]).solve()
    np.testing.assert_allclose(got, v.value, atol=2e-5)
    assert got[seed % n] == 0.0 and abs(got.sum() - 1.0) < 1e-12
    assert np.any(got <= 1e-12) or np.any(got >= 0.35 - 1e-12)  # some bound is active
