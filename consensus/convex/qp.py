"""The result type of every weigher and the shared simplex QP solve.

``solve_qp_weights`` minimizes ``1/2 w^T Q w + q^T w + lambda ||w - u||^2`` over
the capped simplex with a cached DPP problem (see :mod:`consensus.convex.problems`);
the quadratic-model and anchor objectives (:mod:`consensus.convex.weights`) and the
Newton steps of the mixture NLL (:mod:`consensus.convex.mixture`) all end here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from consensus.convex import problems
from consensus.convex.problems import (
    DEFAULT_SOLVER,
    ProblemCache,
    accepted_mask,
    check_options,
    factor_psd,
    polish_qp,
    project_capped_simplex,
    uniform_weights,
    weight_bounds,
)

PyTree = Any
HIGHEST = jax.lax.Precision.HIGHEST


_BLAS_CONTROLLER: Any = None


def single_threaded_blas(fn):
    """Run fn with the BLAS pool limited to one thread (threadpoolctl, if importable).

    The host-side algebra here is on n x n matrices (n <= a few hundred). With
    OpenBLAS's default pool, an eigh of a 64 x 64 matrix right after a solver
    call can be an order of magnitude slower on a busy machine (threads spinning
    against each other); one thread is the fastest at these sizes.

    Args:
      fn: The function to wrap.

    Returns:
      The wrapped function.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _BLAS_CONTROLLER
        if _BLAS_CONTROLLER is None:
            try:
                from threadpoolctl import ThreadpoolController

                _BLAS_CONTROLLER = ThreadpoolController()
            except ImportError:  # threadpoolctl comes with scikit-learn; without it, do nothing
                _BLAS_CONTROLLER = False
        if _BLAS_CONTROLLER is False:
            return fn(*args, **kwargs)
        with _BLAS_CONTROLLER.limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class ConvexWeights:
    """Result of a convex weighing, the same type for every objective.

    Attributes:
      weights: (n,) float64 on the capped simplex; 0 for rejected nodes.
      objective: the objective at ``weights`` in its own units, computed in
        float64 from the statistics (quadratic: predicted held-out loss;
        mixture_nll: mean NLL; anchor: squared distance), ridge included.
      status: the solver's status ("optimal", "optimal_inaccurate", or why it
        failed).
      solve_time: seconds spent in ``problem.solve`` (for the mixture NLL's Newton method:
        its first-order and Newton iterations and any cvxpy solve); building statistics is
        not included.
      fallback: True when the weights are the uniform fallback.
      message: why the fallback was taken, or notes ("" when none).
      accepted: (n,) bool, the nodes allowed a positive weight.
      objective_name: "quadratic", "mixture_nll", "anchor" or "qp".
      solver: the cvxpy solver used.
      built: True when this call compiled the problem (False: a DPP re-solve).
      iterations: solves performed (1, or the Newton steps).
      gap: an upper bound on ``objective - min objective`` (the Frank-Wolfe duality gap at
        ``weights``; mixture_nll only), NaN where not computed.
    """

    weights: np.ndarray
    objective: float
    status: str
    solve_time: float
    fallback: bool
    message: str
    accepted: np.ndarray
    objective_name: str = "qp"
    solver: str = DEFAULT_SOLVER
    built: bool = False
    iterations: int = 1
    gap: float = math.nan


# ----------------------------------------------------------------------------- QP


def _qp_objective(qm: np.ndarray, q: np.ndarray, c: float, lam: float, u: np.ndarray, w: np.ndarray) -> float:
    return float(0.5 * w @ qm @ w + q @ w + c + lam * np.sum((w - u) ** 2))


@single_threaded_blas
def solve_qp_weights(
    qmat: np.ndarray,
    q: np.ndarray,
    const: float = 0.0,
    *,
    objective_name: str = "qp",
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    min_weight: float = 0.0,
    mask: Any = None,
    solver: str = DEFAULT_SOLVER,
    cache: ProblemCache | None = None,
    solver_options: dict[str, Any] | None = None,
) -> ConvexWeights:
    r"""Weights minimizing a convex quadratic over the capped simplex.

    .. math:: \min_{w \in W} \tfrac12 w^T Q w + q^T w + c + \lambda \|w - u\|^2

    Rows and columns of rejected nodes are ignored (they may hold NaN). The
    problem is scaled by ``max(|Q|, |q|)`` before solving so that the solver's
    tolerances are relative; Q enters through a PSD factor (see
    :mod:`~consensus.convex.problems`).

    Args:
      qmat: (n, n) symmetric PSD matrix Q.
      q: (n,) linear term.
      const: constant c (only changes the reported objective).
      objective_name: name recorded in the result.
      lambda_reg: lambda >= 0, the ridge ``lambda ||w - u||^2`` towards the uniform weights u
        over the accepted nodes.
      max_weight: The cap on every weight, in (0, 1], or None for no cap (1).
      min_weight: The floor on every accepted node's weight, in [0, 1].
      mask: (n,) bool of the nodes allowed a positive weight, or None for all.
      solver: An installed cvxpy solver's name; Clarabel by default.
      cache: The problem cache (default: the process-wide one).
      solver_options: Keyword arguments for ``problem.solve``.

    Returns:
      :class:`ConvexWeights`; a solver failure gives the uniform fallback (``fallback=True``).

    Raises:
      ValueError: If the options are out of range or infeasible (no accepted node, a cap
        below 1/n_accepted, a floor above it), before any solve.
    """
    check_options(lambda_reg, max_weight, min_weight)
    qmat = np.asarray(qmat, np.float64)
    q = np.asarray(q, np.float64)
    n = q.shape[0]
    if qmat.shape != (n, n) or q.shape != (n,):
        raise ValueError(f"Q must be (n, n) and q (n,), got {qmat.shape} and {q.shape}")
    acc = accepted_mask(mask, n)
    lb, ub = weight_bounds(acc, max_weight, min_weight)
    keep = np.outer(acc, acc)
    qmat = np.where(keep, qmat, 0.0)
    q = np.where(acc, q, 0.0)
    u = uniform_weights(acc)
    lam = float(lambda_reg)
    floored = bool(np.any(lb > 0))
    compiled, built = problems.get_problem(
        "qp", n, solver=solver, ridge=lam > 0, floored=floored, cache=cache
    )
    if not (np.all(np.isfinite(qmat)) and np.all(np.isfinite(q)) and math.isfinite(const)):
        return uniform_fallback(
            acc,
            lb,
            ub,
            objective_name,
            compiled,
            built,
            "solver_error",
            0.0,
            "statistics of accepted nodes are not finite",
            lambda w: float("nan"),
        )
    scale = max(float(np.max(np.abs(qmat))), float(np.max(np.abs(q))), 2.0 * lam, 1e-300)
    values: dict[str, Any] = {
        "Lt": factor_psd(qmat / scale, check=True),
        "q": (q - 2.0 * lam * u) / scale,
        "c": (const + lam * float(u @ u)) / scale,
        "ub": ub,
    }
    if lam > 0:
        values["r"] = math.sqrt(lam / scale)
    if floored:
        values["lb"] = lb
    out = problems.solve(compiled, values, solver_options=solver_options)

    def objective(w: np.ndarray) -> float:
        return _qp_objective(qmat, q, const, lam, u, w)

    if out.w is None:
        return uniform_fallback(
            acc, lb, ub, objective_name, compiled, built, out.status, out.solve_time, out.error, objective
        )
    w = project_capped_simplex(out.w, lb, ub)
    polished = polish_qp(qmat + 2.0 * lam * np.eye(n), q - 2.0 * lam * u, w, lb, ub)
    w = w if polished is None else polished
    return ConvexWeights(
        w,
        objective(w),
        out.status,
        out.solve_time,
        False,
        "",
        acc,
        objective_name,
        compiled.key.solver,
        built,
    )


def uniform_fallback(acc, lb, ub, name, compiled, built, status, solve_time, why, objective) -> ConvexWeights:
    """Return the uniform weights over the accepted nodes as a fallback :class:`ConvexWeights`.

    Args:
      acc: (n,) bool, the accepted nodes.
      lb: (n,) lower bounds (unused; kept for a uniform call signature).
      ub: (n,) upper bounds (unused; kept for a uniform call signature).
      name: The objective's name.
      compiled: The compiled problem (its solver is recorded).
      built: Whether this call compiled the problem.
      status: The solver's status.
      solve_time: Seconds spent solving.
      why: Why the fallback was taken (the start of ``message``).
      objective: ``objective(w) -> float``, the objective at the weights.

    Returns:
      A :class:`ConvexWeights` with ``fallback=True``.
    """
    w = uniform_weights(acc)
    return ConvexWeights(
        w,
        objective(w),
        status,
        solve_time,
        True,
        f"{why}; fell back to uniform weights over the {int(acc.sum())} accepted nodes",
        acc,
        name,
        compiled.key.solver,
        built,
    )
