"""cvxpy problem builders for convex merge weights, compiled once and re-solved.

Every problem has one variable, the weight vector ``w`` over the n nodes, and
the constraints of the capped simplex::

    sum(w) == 1,   lb <= w <= ub        (lb, ub: cvxpy Parameters)

The mask of accepted nodes and the caps live in the bounds (a rejected node
has ``ub_i = 0``), so changing which nodes take part, or the caps, never
rebuilds the problem. All data that changes from round to round is a
``cp.Parameter``, and every problem is DPP (disciplined parametrized
programming): the first solve compiles the problem and caches the map from
parameters to solver data, and later solves only re-evaluate that map and call
the solver. Two problem forms exist:

``qp``
    ``min 1/2 ||Lt w||^2 + q^T w + c + ||r w||^2``. A PSD matrix Q is passed as
    a factor ``Lt`` with ``Lt^T Lt = Q``: ``cp.quad_form(w, Q)`` with a
    Parameter Q is not DPP, ``sum_squares(Lt @ w)`` is. ``r = sqrt(lambda)``
    carries the ridge towards uniform weights; its linear and constant parts
    are folded into ``q`` and ``c`` by the caller.
``mixture_nll``
    ``min -(1/m) sum_j log((P w)_j) + ||r w||^2 + s^T w + c``, P an (m, n)
    nonnegative Parameter: the negative log-likelihood of a mixture of the
    nodes' predictive distributions (stacking). Log of an affine function of w,
    so convex; canonicalised with m exponential cones.

Compiled problems are cached in a :class:`ProblemCache` keyed by
(objective, n, m, solver, ridge on, minimum weight on).

The end of the module holds the numerics of the feasible set shared by every
objective: bounds from the mask and options (checked for feasibility before
any solve), the exact Euclidean projection onto it, the PSD factor of a
quadratic and an active-set polish of an interior-point QP solution.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class _Lazy:
    """Import cvxpy on first use.

    It takes over a second to import, and most runs (and every ``import consensus``) never
    build a convex problem.
    """

    def __getattr__(self, name: str) -> Any:
        import cvxpy

        globals()["cp"] = cvxpy  # later lookups skip this proxy
        return getattr(cvxpy, name)


cp: Any = _Lazy()

DEFAULT_SOLVER = "CLARABEL"
# cvxpy statuses whose primal point we accept (after projecting it onto the
# feasible set, which removes the solver's tolerance-sized violations).
ACCEPTED_STATUSES = ("optimal", "optimal_inaccurate")
# cvxpy stores the DPP map of an (m, n) Parameter feeding m cones as a sparse
# tensor whose column index space is about (#variables) x (#parameter entries);
# past this many "n * m * (n + m)" it needs gigabytes (n=16, m=10k: 13 GB).
MAX_DPP_MIXTURE_SIZE = 4e7


@dataclass(frozen=True)
class ProblemKey:
    """What identifies a compiled problem: its form, sizes, solver and options."""

    objective: str
    n: int
    m: int
    solver: str
    ridge: bool
    floored: bool


@dataclass
class CompiledProblem:
    """A DPP cvxpy problem and handles on its variable and Parameters.

    Attributes:
      key: the cache key.
      problem: the ``cp.Problem`` (``problem.is_dpp()`` is True).
      w: the weight variable, shape (n,).
      params: name -> ``cp.Parameter``.
      solves: how many times it was solved.
    """

    key: ProblemKey
    problem: cp.Problem
    w: cp.Variable
    params: dict[str, cp.Parameter]
    solves: int = 0


@dataclass
class SolveOutcome:
    """Raw result of one solve: the solver's point (None if it gave none)."""

    w: np.ndarray | None
    value: float
    status: str
    solve_time: float
    error: str = ""


@dataclass
class ProblemCache:
    """A small LRU cache of compiled problems.

    Args:
      maxsize: how many compiled problems to keep (each holds its DPP map).
    """

    maxsize: int = 32
    _items: OrderedDict[ProblemKey, CompiledProblem] = field(default_factory=OrderedDict)

    def get(self, key: ProblemKey, build: Callable[[], CompiledProblem]) -> tuple[CompiledProblem, bool]:
        """Return the cached problem of ``key``, building (and caching) it on a miss.

        Args:
          key: The problem's key.
          build: Builds the problem on a miss.

        Returns:
          ``(compiled problem, whether it was built now)``.
        """
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key], False
        compiled = build()
        self._items[key] = compiled
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)
        return compiled, True

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, key: ProblemKey) -> CompiledProblem:
        return self._items[key]

    def keys(self) -> list[ProblemKey]:
        """Return the keys of the cached problems, least recently used first."""
        return list(self._items)

    def clear(self) -> None:
        """Drop every cached problem."""
        self._items.clear()


#: The process-wide cache used when a caller passes none.
DEFAULT_CACHE = ProblemCache()


@functools.lru_cache(maxsize=1)
def _installed_solvers() -> tuple[str, ...]:
    # cp.installed_solvers() tries to import every solver module, which costs as much as a
    # whole small re-solve, so ask once per process.
    return tuple(cp.installed_solvers())


def check_solver(solver: str) -> str:
    """Return the solver name upper-cased, or raise ValueError if not installed.

    Args:
      solver: A cvxpy solver's name (any case).

    Returns:
      The upper-cased name.

    Raises:
      TypeError: If ``solver`` is not a string.
      ValueError: If the solver is not installed (the message lists the installed ones).
    """
    if not isinstance(solver, str):
        raise TypeError(f"solver must be a string naming a cvxpy solver, got {type(solver).__name__}")
    name = solver.upper()
    installed = list(_installed_solvers())
    if name not in installed:
        raise ValueError(f"solver {solver!r} is not installed; installed cvxpy solvers: {installed}")
    return name


def _bounds(n: int, w: cp.Variable, floored: bool) -> tuple[list[cp.Constraint], dict[str, cp.Parameter]]:
    ub = cp.Parameter(n, nonneg=True, name="ub")
    params = {"ub": ub}
    cons = [cp.sum(w) == 1, w <= ub]
    if floored:
        lb = cp.Parameter(n, nonneg=True, name="lb")
        params["lb"] = lb
        cons.append(w >= lb)
    else:
        cons.append(w >= 0)
    return cons, params


def build_qp(key: ProblemKey) -> CompiledProblem:
    """Build the DPP problem ``min 1/2 ||Lt w||^2 + q^T w + c (+ ||r w||^2)`` over the capped simplex.

    Args:
      key: The problem's key (n, ridge, floored).

    Returns:
      The :class:`CompiledProblem` (Parameters Lt, q, c, ub, and r, lb when asked).
    """
    n = key.n
    w = cp.Variable(n, name="w")
    lt = cp.Parameter((n, n), name="Lt")
    q = cp.Parameter(n, name="q")
    c = cp.Parameter(name="c")
    cons, params = _bounds(n, w, key.floored)
    params.update(Lt=lt, q=q, c=c)
    obj = 0.5 * cp.sum_squares(lt @ w) + q @ w + c
    if key.ridge:
        r = cp.Parameter(nonneg=True, name="r")
        params["r"] = r
        obj = obj + cp.sum_squares(r * w)
    return CompiledProblem(key, cp.Problem(cp.Minimize(obj), cons), w, params)


def build_mixture_nll(key: ProblemKey) -> CompiledProblem:
    """Build the DPP problem ``min -(1/m) sum_j log((P w)_j) (+ ||r w||^2 + s^T w + c)`` over the simplex.

    The simplex is the capped one (``ub``, and ``lb`` when floored).

    Args:
      key: The problem's key (n, m, ridge, floored).

    Returns:
      The :class:`CompiledProblem` (Parameters P, ub, and r, s, c, lb when asked).
    """
    n, m = key.n, key.m
    w = cp.Variable(n, name="w")
    p = cp.Parameter((m, n), nonneg=True, name="P")
    cons, params = _bounds(n, w, key.floored)
    params["P"] = p
    obj = -cp.sum(cp.log(p @ w)) / m
    if key.ridge:
        r = cp.Parameter(nonneg=True, name="r")
        s = cp.Parameter(n, name="s")
        c = cp.Parameter(name="c")
        params.update(r=r, s=s, c=c)
        obj = obj + cp.sum_squares(r * w) + s @ w + c
    return CompiledProblem(key, cp.Problem(cp.Minimize(obj), cons), w, params)


BUILDERS: dict[str, Callable[[ProblemKey], CompiledProblem]] = {
    "qp": build_qp,
    "mixture_nll": build_mixture_nll,
}


def get_problem(
    objective: str,
    n: int,
    *,
    m: int = 0,
    solver: str = DEFAULT_SOLVER,
    ridge: bool = False,
    floored: bool = False,
    cache: ProblemCache | None = None,
) -> tuple[CompiledProblem, bool]:
    """The compiled problem for these sizes and options, built on first use.

    Args:
      objective: "qp" or "mixture_nll".
      n: number of nodes.
      m: number of held-out examples (mixture_nll only; 0 otherwise).
      solver: an installed cvxpy solver name.
      ridge: whether the problem has the ridge term.
      floored: whether the problem has a minimum-weight Parameter.
      cache: where to look; :data:`DEFAULT_CACHE` if None.

    Returns:
      (compiled problem, True if it was built by this call).

    Raises:
      ValueError: If the objective is unknown or the solver not installed.
    """
    if objective not in BUILDERS:
        raise ValueError(f"unknown problem form {objective!r}; known: {sorted(BUILDERS)}")
    key = ProblemKey(objective, int(n), int(m), check_solver(solver), bool(ridge), bool(floored))
    cache = DEFAULT_CACHE if cache is None else cache
    return cache.get(key, lambda: BUILDERS[objective](key))


def solve(
    compiled: CompiledProblem,
    values: dict[str, Any],
    *,
    solver_options: dict[str, Any] | None = None,
) -> SolveOutcome:
    """Set the Parameters from ``values`` and solve; never raises for solver trouble.

    Exceptions from the solver, statuses other than optimal/optimal_inaccurate
    and non-finite points come back as an outcome with ``w=None`` and the reason
    in ``error``; the caller decides the fallback.

    Args:
      compiled: The compiled problem.
      values: Parameter name -> value, one for every Parameter of the problem.
      solver_options: Keyword arguments for ``problem.solve``.

    Returns:
      The :class:`SolveOutcome`.

    Raises:
      ValueError: If a Parameter's value is missing (a caller's error, not the solver's).
    """
    missing = set(compiled.params) - set(values)
    if missing:
        raise ValueError(f"values for Parameters {sorted(missing)} are missing")
    for name, param in compiled.params.items():
        param.value = values[name]
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # "Solution may be inaccurate": reported through the status instead.
            warnings.simplefilter("ignore", UserWarning)
            # warm_start=True reuses the solver's workspace between rounds; pass
            # solver_options={"warm_start": False} when results must not depend on earlier solves.
            options = {"warm_start": True, **(solver_options or {})}
            compiled.problem.solve(solver=compiled.key.solver, **options)
    except (cp.error.SolverError, ArithmeticError, ValueError) as err:
        elapsed = time.perf_counter() - start
        return SolveOutcome(
            None, float("nan"), "solver_error", elapsed, f"solver raised {type(err).__name__}: {err}"
        )
    elapsed = time.perf_counter() - start
    compiled.solves += 1
    status = str(compiled.problem.status)
    w = compiled.w.value
    value = compiled.problem.value
    value = float(value) if value is not None else float("nan")
    if status not in ACCEPTED_STATUSES:
        return SolveOutcome(None, value, status, elapsed, f"solver status {status!r}")
    if w is None or not np.all(np.isfinite(w)):
        return SolveOutcome(None, value, status, elapsed, "solver returned a non-finite point")
    return SolveOutcome(np.asarray(w, np.float64), value, status, elapsed)


# ----------------------------------------------------------------------------- the feasible set

# Slack on the feasibility checks (1/(n-f) caps times n-f accepted nodes sum to
# 1 - 1e-16, which is feasible: the only point is then the uniform weights).
FEAS_TOL = 1e-9


def accepted_mask(mask: Any, n: int) -> np.ndarray:
    """Check a (n,) boolean mask (None: all True) and return it as numpy.

    Args:
      mask: A (n,) boolean array, or None.
      n: The number of nodes.

    Returns:
      A (n,) numpy bool copy.

    Raises:
      TypeError: If the mask is not boolean.
      ValueError: If its shape is not (n,).
    """
    if mask is None:
        return np.ones(n, bool)
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array of shape ({n},), got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"mask must have shape ({n},) (one entry per node), got {arr.shape}")
    return arr.copy()


def check_options(lambda_reg: float, max_weight: float | None, min_weight: float) -> None:
    """Raise ValueError unless lambda_reg >= 0, max_weight in (0, 1] or None, min_weight in [0, 1].

    Args:
      lambda_reg: The ridge weight.
      max_weight: The cap, or None.
      min_weight: The floor.

    Raises:
      ValueError: If one of them is out of range.
    """
    if not (isinstance(lambda_reg, int | float) and math.isfinite(lambda_reg) and lambda_reg >= 0):
        raise ValueError(f"lambda_reg must be a finite number >= 0, got {lambda_reg!r}")
    if max_weight is not None and not (0 < max_weight <= 1):
        raise ValueError(f"max_weight must be in (0, 1] or None, got {max_weight!r}")
    if not (0 <= min_weight <= 1):
        raise ValueError(f"min_weight must be in [0, 1], got {min_weight!r}")


def weight_bounds(
    accepted: np.ndarray, max_weight: float | None = None, min_weight: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Return the bounds (lb, ub) of the capped simplex, checked for feasibility.

    A cap or floor equal to 1/n_accepted up to rounding is snapped to it: the only feasible
    point is then the uniform weights.

    Args:
      accepted: (n,) bool, the nodes allowed a positive weight.
      max_weight: The cap, or None for 1.
      min_weight: The floor on accepted nodes.

    Returns:
      ``(lb, ub)``, (n,) float64 each; both 0 for rejected nodes.

    Raises:
      ValueError: Before any solve, when no node is accepted, when the cap is below
        1/n_accepted (``sum(ub) < 1``) or the minimum weight above it (``sum(lb) > 1``).
    """
    check_options(0.0, max_weight, min_weight)
    acc = np.asarray(accepted, bool)
    k = int(acc.sum())
    if k == 0:
        raise ValueError(
            f"all {acc.size} nodes are rejected (by the vote or non-finite values); nothing to weigh"
        )
    cap = 1.0 if max_weight is None else float(max_weight)
    if cap * k < 1.0 - FEAS_TOL:
        raise ValueError(
            f"max_weight={cap:g} is infeasible with {k} accepted nodes: the weights must sum to 1, "
            f"so the cap must be at least 1/{k} = {1.0 / k:.6g}"
        )
    if min_weight * k > 1.0 + FEAS_TOL:
        raise ValueError(
            f"min_weight={min_weight:g} is infeasible with {k} accepted nodes: the weights must sum to 1, "
            f"so the minimum weight must be at most 1/{k} = {1.0 / k:.6g}"
        )
    cap = max(cap, 1.0 / k)
    floor = min(float(min_weight), 1.0 / k)
    return floor * acc.astype(np.float64), cap * acc.astype(np.float64)


def project_capped_simplex(v: np.ndarray, lb: np.ndarray, ub: np.ndarray) -> np.ndarray:
    """Euclidean projection of v onto {sum w = 1, lb <= w <= ub} (float64, exact).

    The projection is ``clip(v - tau, lb, ub)`` for the tau with sum 1. The sum
    s(tau) is non-increasing and piecewise linear with breakpoints at
    ``v - ub`` (a coordinate leaves its cap) and ``v - lb`` (it reaches its
    floor); between breakpoints its slope is minus the number of coordinates
    strictly inside their bounds. Sorting the 2n breakpoints and accumulating
    slope times length gives s at every breakpoint in O(n log n); tau is the
    linear interpolation on the segment where s crosses 1. (The cross-device
    solvers project hundreds of times per round at n in the hundreds, where
    evaluating the sum at every breakpoint, O(n^2), was the cost.)

    Args:
      v: (n,) the point to project.
      lb: (n,) lower bounds.
      ub: (n,) upper bounds (``sum(lb) <= 1 <= sum(ub)``).

    Returns:
      (n,) float64, the projection.
    """
    v = np.asarray(v, np.float64)
    lb = np.asarray(lb, np.float64)
    ub = np.asarray(ub, np.float64)
    width = (ub > lb).astype(np.float64)  # a fixed coordinate (lb == ub) never changes the slope
    points = np.concatenate([v - ub, v - lb])
    order = np.argsort(points, kind="stable")
    taus = points[order]
    inside = np.cumsum(np.concatenate([width, -width])[order])  # free coordinates right of each point
    sums = np.empty_like(taus)
    sums[0] = ub.sum()  # left of every breakpoint each coordinate sits at its cap
    sums[1:] = sums[0] - np.cumsum(inside[:-1] * np.diff(taus))
    k = int(np.searchsorted(-sums, -1.0, side="left"))  # first breakpoint with sum <= 1
    if k == 0:
        tau = taus[0]
    elif k == len(taus):
        tau = taus[-1]
    else:
        t0, t1, s0, s1 = taus[k - 1], taus[k], sums[k - 1], sums[k]
        tau = t1 if s0 == s1 else t0 + (s0 - 1.0) * (t1 - t0) / (s0 - s1)
    w = np.clip(v - tau, lb, ub)
    # Spread the last rounding residue over the coordinates strictly inside.
    free = (w > lb) & (w < ub)
    if free.any():
        w[free] += (1.0 - w.sum()) / free.sum()
        w = np.clip(w, lb, ub)
    return w


def uniform_weights(accepted: np.ndarray) -> np.ndarray:
    """Return the uniform weights over the accepted nodes (feasible for any feasible bounds).

    Args:
      accepted: (n,) bool, the accepted nodes.

    Returns:
      (n,) float64 weights, 1 / n_accepted on accepted nodes, 0 elsewhere.
    """
    acc = np.asarray(accepted, bool)
    return acc.astype(np.float64) / acc.sum()


# Relative size of a negative eigenvalue of Q still taken as rounding (float32 Gram
# statistics of nearly collinear deltas have eigenvalues of order -1e-7 |Q|).
PSD_TOL = 1e-5


def factor_psd(q: np.ndarray, *, check: bool = False) -> np.ndarray:
    """Return Lt with ``Lt.T @ Lt = Q`` for a symmetric PSD Q (rounding-sized negative eigenvalues clipped).

    Args:
      q: (n, n) matrix Q (symmetrized first).
      check: Refuse a Q that is not PSD beyond rounding.

    Returns:
      (n, n) float64 Lt.

    Raises:
      ValueError: With ``check``, when Q has an eigenvalue below ``-PSD_TOL * max|eig|``:
        the problem would not be convex.
    """
    q = 0.5 * (q + q.T)
    vals, vecs = np.linalg.eigh(q)
    top = float(np.max(np.abs(vals), initial=0.0))
    if check and vals.size and vals[0] < -PSD_TOL * top:
        raise ValueError(
            f"Q is not positive semi-definite: smallest eigenvalue {vals[0]:.3g} vs largest |eigenvalue| "
            f"{top:.3g}; the quadratic objective must be convex"
        )
    return (vecs * np.sqrt(np.clip(vals, 0.0, None))).T


def polish_qp(
    qmat: np.ndarray, q: np.ndarray, w: np.ndarray, lb: np.ndarray, ub: np.ndarray, tol: float = 1e-6
) -> np.ndarray | None:
    """Refine an interior-point solution of ``min 1/2 w^T Q w + q^T w`` over the capped simplex.

    Interior-point solvers stop with every weight a little inside its bounds
    (about 1e-6 here), which matters when the objective is nearly flat (an
    anchor inside the nodes' hull has optimal value 0). Like OSQP's polish:
    guess the active set from ``w`` (within ``tol`` of a bound), solve the KKT
    system of the equality-constrained QP on the free coordinates, and return
    the result only if it is feasible, its multipliers have the right signs
    and its objective is no worse; otherwise None.

    Args:
      qmat: (n, n) Q.
      q: (n,) linear term.
      w: (n,) the solver's point.
      lb: (n,) lower bounds.
      ub: (n,) upper bounds.
      tol: Distance to a bound that counts as active.

    Returns:
      The polished (n,) weights, or None when the polish does not apply.
    """
    fixed = ub - lb <= 0.0
    at_lb = (w - lb <= tol) & ~fixed
    at_ub = (ub - w <= tol) & ~fixed & ~at_lb
    free = ~(fixed | at_lb | at_ub)
    k = int(free.sum())
    if k == 0:
        return None
    w_fix = np.where(at_ub, ub, lb)
    w_fix[free] = 0.0
    kkt = np.zeros((k + 1, k + 1))
    kkt[:k, :k] = qmat[np.ix_(free, free)]
    kkt[:k, k] = 1.0
    kkt[k, :k] = 1.0
    rhs = np.concatenate([-(q[free] + qmat[free] @ w_fix), [1.0 - w_fix.sum()]])
    sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
    w_new = w_fix.copy()
    w_new[free] = sol[:k]
    nu = sol[k]
    scale = max(float(np.max(np.abs(qmat))), float(np.max(np.abs(q))), 1e-300)
    if np.any(w_new < lb - 1e-12) or np.any(w_new > ub + 1e-12) or abs(w_new.sum() - 1.0) > 1e-9:
        return None
    # Stationarity on the free set, and multipliers of the right sign on the active bounds.
    mult = qmat @ w_new + q + nu
    if np.max(np.abs(mult[free]), initial=0.0) > 1e-8 * scale:
        return None
    if np.any(mult[at_lb] < -1e-9 * scale) or np.any(mult[at_ub] > 1e-9 * scale):
        return None

    def f(x: np.ndarray) -> float:
        return float(0.5 * x @ qmat @ x + q @ x)

    if f(w_new) > f(w) + 1e-12 * max(1.0, abs(f(w))):
        return None
    return np.clip(w_new, lb, ub)
