"""Mixture-NLL (stacking) weights: the NLL of the mixture of the nodes' predictions.

Convex in w (minus the log of an affine function). Solved through cvxpy's exponential
cone when the Parameter fits in memory, or by damped Newton steps started from an
accelerated projected gradient and certified by the Frank-Wolfe duality gap, with cvxpy
as the fallback when the certificate is not met.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from consensus.convex import problems
from consensus.convex.firstorder import accelerated_projected_gradient, frank_wolfe_gap
from consensus.convex.qp import ConvexWeights, single_threaded_blas, uniform_fallback

PyTree = Any
# Probabilities are floored here before the log: a node that gives a held-out
# example probability 0 would otherwise make the objective infinite for any
# weight vector that relies on it alone.
PROB_FLOOR = 1e-12
# The duality gap (in nats of mean NLL) the first-order phase stops at: close enough for
# the Newton steps after it to start on the optimum's support, where each step's QP is a
# few small linear solves.
WARM_GAP = 1e-4


def _mixture_objective(pt: np.ndarray, lam: float, u: np.ndarray, w: np.ndarray) -> float:
    z = pt @ w
    return float(-np.mean(np.log(z)) + lam * np.sum((w - u) ** 2))


def _mixture_gradient(pt: np.ndarray, lam: float, u: np.ndarray, w: np.ndarray) -> np.ndarray:
    return -(pt.T @ (1.0 / (pt @ w))) / pt.shape[0] + 2.0 * lam * (w - u)


def _gap(pt: np.ndarray, lam: float, u: np.ndarray, w: np.ndarray, lb: np.ndarray, ub: np.ndarray) -> float:
    return frank_wolfe_gap(_mixture_gradient(pt, lam, u, w), w, lb, ub)


@single_threaded_blas
def mixture_nll_weights(
    probs: Any,
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    mask: Any = None,
    *,
    min_weight: float = 0.0,
    solver: str = problems.DEFAULT_SOLVER,
    method: str = "auto",
    floor: float = PROB_FLOOR,
    cache: problems.ProblemCache | None = None,
    solver_options: dict[str, Any] | None = None,
    tol: float = 1e-10,
    max_iter: int = 50,
    gap_tol: float = 1e-9,
    warm_iter: int = 500,
) -> ConvexWeights:
    r"""Stacking weights: minimize the held-out NLL of the mixture of the nodes.

    .. math:: \min_{w \in W} -\frac1m \sum_{j=1}^m \log\Big(\sum_i w_i P_{ij}\Big)
              + \lambda \|w - u\|^2

    ``P[i, j]`` is node i's predicted probability of the true label of held-out
    example j. Convex in w (minus the log of an affine function). Entries are
    floored at ``floor`` (1e-12) so the objective stays finite.

    Two exact methods:

    * ``"conic"``: the problem above in cvxpy with P as an (m, n) Parameter
      (m exponential cones), compiled once and re-solved. cvxpy's DPP map for
      it needs index space ~ n*m*(n+m), so it is used up to
      ``problems.MAX_DPP_MIXTURE_SIZE``.
    * ``"newton"``: accelerated projected gradient (FISTA, see
      :func:`~consensus.convex.firstorder.accelerated_projected_gradient`) from
      the uniform weights until the duality gap is below 1e-4, then damped
      Newton steps from there: each a QP over W with the exact gradient and
      Hessian ``(1/m) P diag(1/z^2) P^T`` (z = P^T w), solved by a primal
      active-set method on the current support (the cached cvxpy ``qp``
      problem when that cannot certify the step), with a backtracking line
      search; -log of an affine function is self-concordant, so this converges
      globally and quadratically near the optimum. It stops when the Newton
      decrement ``-g^T d`` is below ``tol`` and the Frank-Wolfe duality gap
      ``g^T (w - s)`` (s the vertex of W minimizing ``g^T s``), an upper bound on
      the distance of the objective to its optimum, is below ``gap_tol``. When
      the gap is not reached in ``max_iter`` steps, the problem goes to cvxpy
      (the conic form when it fits, else Newton with every step solved by
      cvxpy) and the better certified point is returned. Scales to any m, and
      to n in the thousands: the first-order phase finds the optimum's support
      where an active-set method from the uniform weights pays one dense
      factorisation per dropped node.

    ``"auto"`` picks conic when it fits, else Newton. Every result reports its
    duality gap in ``gap``.

    Args:
      probs: (n, m) probabilities in [0, 1]. Rows with NaN/Inf reject the node.
      lambda_reg: lambda >= 0, the ridge ``lambda ||w - u||^2`` towards the uniform weights u
        over the accepted nodes.
      max_weight: The cap on every weight, in (0, 1], or None for no cap (1).
      min_weight: The floor on every accepted node's weight, in [0, 1].
      mask: (n,) bool of the nodes allowed a positive weight, or None for all.
      solver: An installed cvxpy solver's name; Clarabel by default.
      cache: The problem cache (default: the process-wide one).
      solver_options: Keyword arguments for ``problem.solve``.
      method: "auto", "conic" or "newton".
      floor: probability floor (> 0).
      tol: Newton's stopping tolerance on the decrement ``-g^T d``.
      max_iter: The largest number of Newton steps.
      gap_tol: Newton's stopping tolerance on the duality gap, > 0 (mean NLL, nats).
      warm_iter: The largest number of first-order steps before Newton's (0: start Newton
        from the uniform weights).

    Returns:
      :class:`ConvexWeights`; ``objective`` is the mean NLL (plus the ridge), ``gap`` the
      duality gap at ``weights``.

    Raises:
      ValueError: If ``probs`` is not (n, m), ``method``, ``floor`` or ``gap_tol`` is invalid, or
        the options are out of range or infeasible.

    Example:
      >>> probs = np.array([[0.9, 0.8], [0.1, 0.2], [0.5, 0.6]])  # 3 nodes, 2 held-out examples
      >>> res = mixture_nll_weights(probs, max_weight=0.5)
      >>> np.allclose(res.weights, [0.5, 0.0, 0.5], atol=1e-4)  # the best node at its cap, then node 2
      True
      >>> mixture_probs = res.weights @ probs

    References:
      Wolpert, "Stacked generalization", 1992; Breiman, "Stacked regressions", 1996;
      Cover, "An algorithm for maximizing expected log investment return", 1984.
    """
    problems.check_options(lambda_reg, max_weight, min_weight)
    if method not in ("auto", "conic", "newton"):
        raise ValueError(f"method must be 'auto', 'conic' or 'newton', got {method!r}")
    if not (0 < floor < 1):
        raise ValueError(f"floor must be in (0, 1), got {floor!r}")
    if not (isinstance(gap_tol, int | float) and gap_tol > 0):
        raise ValueError(f"gap_tol must be a number > 0, got {gap_tol!r}")
    if warm_iter < 0:
        raise ValueError(f"warm_iter must be >= 0, got {warm_iter!r}")
    p = np.asarray(probs, np.float64)
    if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
        raise ValueError(f"probs must be (n nodes, m examples) with n, m >= 1, got shape {p.shape}")
    n, m = p.shape
    acc = problems.accepted_mask(mask, n) & np.all(np.isfinite(p), axis=1)
    lb, ub = problems.weight_bounds(acc, max_weight, min_weight)
    pa = p[acc]
    if pa.min() < -1e-6 or pa.max() > 1 + 1e-6:
        raise ValueError(
            f"probs must be probabilities in [0, 1]; found values in [{pa.min():g}, {pa.max():g}]"
        )
    # Rejected rows get the floor: their weight is 0, any finite value works.
    pt = np.where(acc[:, None], np.clip(p, floor, 1.0), floor).T.copy()
    lam = float(lambda_reg)
    u = problems.uniform_weights(acc)
    fits_conic = n * m * (n + m) <= problems.MAX_DPP_MIXTURE_SIZE
    if method == "auto":
        method = "conic" if fits_conic else "newton"

    def objective(w: np.ndarray) -> float:
        return _mixture_objective(pt, lam, u, w)

    if method == "conic":
        return _mixture_conic(pt, acc, lb, ub, lam, u, solver, cache, solver_options, objective)
    start = time.perf_counter()
    w0 = u
    if warm_iter > 0:
        warm = accelerated_projected_gradient(
            objective,
            lambda w: (objective(w), _mixture_gradient(pt, lam, u, w)),
            problems.project_capped_simplex(u, lb, ub),
            lb,
            ub,
            gap_tol=max(WARM_GAP, gap_tol),
            max_iter=warm_iter,
        )
        w0 = warm.weights
    res = _mixture_newton(
        pt, acc, lb, ub, lam, u, solver, cache, solver_options, tol, max_iter, objective, w0, gap_tol
    )
    res = _with(res, solve_time=time.perf_counter() - start)
    if res.gap <= gap_tol:
        return res
    # Not certified: cvxpy solves it (every Newton step a cvxpy QP when the cones do not fit).
    if fits_conic:
        ref = _mixture_conic(pt, acc, lb, ub, lam, u, solver, cache, solver_options, objective)
    else:
        ref = _mixture_newton(
            pt, acc, lb, ub, lam, u, solver, cache, solver_options, tol, max_iter, objective, u, gap_tol, True
        )
    best = ref if not ref.fallback and ref.objective < res.objective else res
    status = best.status if best.fallback else "optimal" if best.gap <= gap_tol else "optimal_inaccurate"

    def said(r: ConvexWeights) -> str:
        return f"{r.status}, gap {r.gap:.3g}" + (f" ({r.message})" if r.message else "")

    note = (
        f"Newton after {res.iterations} steps: {said(res)}, above gap_tol {gap_tol:g}; cvxpy: {said(ref)}; "
        + ("kept cvxpy's point" if best is ref else "kept the Newton point")
    )
    return _with(best, status=status, solve_time=time.perf_counter() - start, message=note)


def _with(res: ConvexWeights, **changes: Any) -> ConvexWeights:
    return dataclasses.replace(res, **changes)


def _mixture_conic(pt, acc, lb, ub, lam, u, solver, cache, solver_options, objective) -> ConvexWeights:
    """The exponential-cone problem in cvxpy, compiled once per size and re-solved."""
    n, m = pt.shape[1], pt.shape[0]
    floored = bool(np.any(lb > 0))
    compiled, built = problems.get_problem(
        "mixture_nll", n, m=m, solver=solver, ridge=lam > 0, floored=floored, cache=cache
    )
    values: dict[str, Any] = {"P": pt, "ub": ub}
    if lam > 0:
        values.update(r=math.sqrt(lam), s=-2.0 * lam * u, c=lam * float(u @ u))
    if floored:
        values["lb"] = lb
    out = problems.solve(compiled, values, solver_options=solver_options)
    if out.w is None:
        return uniform_fallback(
            acc, lb, ub, "mixture_nll", compiled, built, out.status, out.solve_time, out.error, objective
        )
    w = problems.project_capped_simplex(out.w, lb, ub)
    return ConvexWeights(
        w,
        objective(w),
        out.status,
        out.solve_time,
        False,
        "",
        acc,
        "mixture_nll",
        compiled.key.solver,
        built,
        gap=_gap(pt, lam, u, w, lb, ub),
    )


def _kkt_step(
    h: np.ndarray, lin: np.ndarray, w: np.ndarray, lb: np.ndarray, ub: np.ndarray
) -> np.ndarray | None:
    """The QP ``min 1/2 v^T h v + lin^T v`` over the capped simplex by a primal active-set method.

    Starts at the feasible iterate ``w`` (Nocedal and Wright, Numerical Optimization, 16.3):
    solve the equality-constrained QP with the active bounds fixed, move towards its
    solution until a bound blocks (then that bound joins the active set), and at a
    stationary point release the bound whose multiplier has the wrong sign. The result is
    returned only when ``problems.polish_qp`` verifies the KKT conditions at it (feasible,
    stationary on the free set, bound multipliers of the right sign), which certifies the
    convex QP's optimum; None (singular or unbounded subproblems, no convergence in a few
    dozen iterations) leaves the step to the cvxpy solver. After the first Newton step the
    active set rarely changes, so this usually ends in one or two linear solves.
    """
    fixed = ub - lb <= 0.0
    v = np.clip(w, lb, ub)
    at_lb = (v - lb <= 1e-9) & ~fixed
    at_ub = (ub - v <= 1e-9) & ~fixed & ~at_lb
    v = np.where(at_lb, lb, np.where(at_ub, ub, v))
    scale = max(float(np.max(np.abs(h))), float(np.max(np.abs(lin))), 1e-300)
    for _ in range(4 * len(w) + 4):
        free = ~(fixed | at_lb | at_ub)
        k = int(free.sum())
        if k == 0:
            return None
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k] = h[np.ix_(free, free)]
        kkt[:k, k] = kkt[k, :k] = 1.0
        # Step p on the free coordinates: min 1/2 p^T H p + grad^T p with sum p = 0.
        grad = h @ v + lin
        sol = np.linalg.lstsq(kkt, np.concatenate([-grad[free], [0.0]]), rcond=None)[0]
        p = np.zeros_like(v)
        p[free] = sol[:k]
        nu = sol[k]
        if np.max(np.abs(h[np.ix_(free, free)] @ p[free] + grad[free] + nu), initial=0.0) > 1e-9 * scale:
            return None  # no stationary point on this face (singular and inconsistent): cvxpy
        if np.max(np.abs(p)) <= 1e-12:
            mult = grad + nu  # stationarity: mult = mu_lb - mu_ub on the active bounds
            wrong = np.where(at_lb, -mult, 0.0) + np.where(at_ub, mult, 0.0)
            i = int(np.argmax(wrong))
            if wrong[i] <= 1e-12 * scale:
                return problems.polish_qp(h, lin, v, lb, ub)
            at_lb[i] = at_ub[i] = False
            continue
        # The longest step in [0, 1] along p inside the bounds; a blocking bound joins the set.
        with np.errstate(divide="ignore", invalid="ignore"):
            to_bound = np.where(p < 0, (lb - v) / p, np.where(p > 0, (ub - v) / p, np.inf))
        to_bound = np.where(free, to_bound, np.inf)
        j = int(np.argmin(to_bound))
        alpha = min(1.0, max(0.0, float(to_bound[j])))  # a rounding overshoot never steps back
        v = v + alpha * p
        if alpha < 1.0:
            if p[j] < 0:
                v[j], at_lb[j] = lb[j], True
            else:
                v[j], at_ub[j] = ub[j], True
        v = np.clip(v, lb, ub)
    return None


def _mixture_newton(
    pt,
    acc,
    lb,
    ub,
    lam,
    u,
    solver,
    cache,
    solver_options,
    tol,
    max_iter,
    objective,
    w0,
    gap_tol,
    cvxpy_only=False,
) -> ConvexWeights:
    """Damped Newton from ``w0``; each step's QP by the active-set method, else (or always) by cvxpy."""
    n = pt.shape[1]
    m = pt.shape[0]
    floored = bool(np.any(lb > 0))
    # The cvxpy QP is built only when a step needs it: building the problem of n = 500 costs
    # about a second, and the active-set method almost always certifies the step itself.
    compiled: problems.CompiledProblem | None = None
    built = False
    w = problems.project_capped_simplex(w0, lb, ub)
    f = objective(w)
    total = 0.0
    status, note = "optimal_inaccurate", f"Newton did not reach decrement {tol:g} in {max_iter} steps"
    gap = math.inf
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        z = pt @ w
        a = pt / z[:, None]  # (m, n): P_ji / z_j
        g = -a.mean(axis=0) + 2.0 * lam * (w - u)
        g = np.where(acc, g, 0.0)
        gap = frank_wolfe_gap(g, w, lb, ub)
        h = a.T @ a / m + 2.0 * lam * np.eye(n)
        h = np.where(np.outer(acc, acc), h, 0.0)
        # The QP in the new point v: 1/2 v^T H v + (g - H w)^T v, scaled for the solver.
        lin = g - h @ w
        # The step's QP is solved by a primal active-set method from the current iterate,
        # accepted only with its KKT conditions verified (_kkt_step); only when that cannot
        # certify an optimum does the step go to the cvxpy solver, whose every solve costs a
        # sizeable share of a digits round's coordinator work.
        direct = None if cvxpy_only else _kkt_step(h, lin, w, lb, ub)
        if direct is not None:
            d = direct - w
        else:
            if compiled is None:
                compiled, built = problems.get_problem(
                    "qp", n, solver=solver, ridge=False, floored=floored, cache=cache
                )
            scale = max(float(np.max(np.abs(h))), float(np.max(np.abs(lin))), 1e-300)
            values: dict[str, Any] = {
                "Lt": problems.factor_psd(h / scale),
                "q": lin / scale,
                "c": 0.0,
                "ub": ub,
            }
            if floored:
                values["lb"] = lb
            out = problems.solve(compiled, values, solver_options=solver_options)
            total += out.solve_time
            if out.w is None:
                return uniform_fallback(
                    acc,
                    lb,
                    ub,
                    "mixture_nll",
                    compiled,
                    built,
                    out.status,
                    total,
                    f"Newton step {it}: {out.error}",
                    objective,
                )
            v = problems.project_capped_simplex(out.w, lb, ub)
            polished = problems.polish_qp(h, lin, v, lb, ub)
            d = (v if polished is None else polished) - w
        dec = float(-g @ d)
        # The decrement alone can pass while the gap does not: a bound whose multiplier is off
        # by e costs ~e^2 in decrement but ~e in the gap, so both are asked for.
        if dec <= tol and gap <= gap_tol:
            status, note = "optimal", ""
            break
        t = 1.0
        while t > 1e-12:
            f_new = objective(w + t * d)
            if f_new <= f - 0.25 * t * dec:
                break
            t *= 0.5
        else:
            status, note = "optimal", "line search made no progress (at the optimum to rounding)"
            break
        w, f = w + t * d, f_new
    w = problems.project_capped_simplex(w, lb, ub)
    gap = _gap(pt, lam, u, w, lb, ub)
    if status == "optimal" and gap > gap_tol:
        status = "optimal_inaccurate"
    name = problems.check_solver(solver) if compiled is None else compiled.key.solver
    return ConvexWeights(
        w, objective(w), status, total, False, note, acc, "mixture_nll", name, built, it, gap=gap
    )
