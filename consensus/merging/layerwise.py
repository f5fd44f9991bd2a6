r"""Layer-wise convex merge weights: one simplex of node weights per leaf (or group of leaves).

The task-wise objectives of :mod:`consensus.convex` choose one weight per node.
Layer-wise AdaMerging (Yang et al., "AdaMerging: Adaptive Model Merging for
Multi-Task Learning", ICLR 2024) showed that one coefficient per node *and
layer* merges far better. Here the same quadratic model of the held-out loss
as :func:`consensus.quadratic_weights` (gradient g and diagonal curvature h at
a reference theta_0) is minimized over one simplex per group of leaves:

.. math:: \min_{W} \sum_{l} \Big[ q_l^\top w_l + \tfrac12 w_l^\top Q_l w_l
          + \lambda \lVert w_l - u\rVert^2 \Big],\quad
          w_l \ge 0,\ \textstyle\sum_i w_{l,i} = 1,\ w_{l,i} \le \text{ub}_i

with ``Q_l = D_l H_l D_l^T`` and ``q_l = D_l g_l`` over the leaves of group l
(rows of D_l: the deltas ``x_i - theta_0`` there). With a diagonal curvature
the groups decouple, but they are solved as one DPP cvxpy problem (every
Q-factor, q and bound a ``cp.Parameter``), compiled once per (groups, n) and
re-solved every round. With one group it is the task-wise QP.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.convex.problems import DEFAULT_SOLVER, accepted_mask, cp, factor_psd, project_capped_simplex
from kernels import gram as gram_kernels
from kernels.compile_options import kernel_jit

PyTree = Any
HIGHEST = jax.lax.Precision.HIGHEST


def group_names(params: PyTree, groups: str | Callable[[str], str] | None) -> list[str]:
    """Return the group of every leaf of ``params``.

    Args:
      params: A tree.
      groups: ``None`` or ``"leaf"`` (one group per leaf), ``"module"`` (by the path without
        its last key), ``"all"`` (one group: task-wise) or a function of the leaf path.

    Returns:
      One group name per leaf, in leaf order.

    Raises:
      ValueError: If ``groups`` is none of these.
    """
    paths = tree.leaf_paths(params)
    if groups is None or groups == "leaf":
        return paths
    if groups == "all":
        return ["all"] * len(paths)
    if groups == "module":
        return [p.rsplit("[", 1)[0] if p.count("[") > 1 else p for p in paths]
    if callable(groups):
        return [str(groups(p)) for p in paths]
    raise ValueError(
        f"groups must be None, 'leaf', 'module', 'all' or a function of the leaf path, got {groups!r}"
    )


@kernel_jit
def _leaf_stats(x, ref, g, h):
    n = x.shape[0]
    d = x.astype(jnp.float32) - ref.astype(jnp.float32)[None]
    s = jnp.sqrt(jnp.maximum(h.astype(jnp.float32), 0.0))
    qmat = gram_kernels.gram(d * s[None])
    q = jnp.dot(d.reshape(n, -1), g.astype(jnp.float32).reshape(-1), precision=HIGHEST)
    return qmat, q


@dataclass
class _Compiled:
    problem: Any
    w: Any
    lt: list
    q: list
    ub: Any
    r: Any


_CACHE: dict[tuple[int, int, bool], _Compiled] = {}


def _build(num_groups: int, n: int, ridge: bool) -> _Compiled:
    key = (num_groups, n, ridge)
    if key in _CACHE:
        return _CACHE[key]
    w = cp.Variable((num_groups, n), name="W")
    lts = [cp.Parameter((n, n), name=f"Lt{g}") for g in range(num_groups)]
    qs = [cp.Parameter(n, name=f"q{g}") for g in range(num_groups)]
    ub = cp.Parameter(n, nonneg=True, name="ub")
    r = cp.Parameter(nonneg=True, name="r") if ridge else None
    u = cp.Parameter(n, name="u") if ridge else None
    obj = 0
    cons = [w >= 0, cp.sum(w, axis=1) == 1]
    for g in range(num_groups):
        obj = obj + 0.5 * cp.sum_squares(lts[g] @ w[g]) + qs[g] @ w[g]
        cons.append(w[g] <= ub)
        if ridge:
            obj = obj + cp.sum_squares(r * (w[g] - u))
    problem = cp.Problem(cp.Minimize(obj), cons)
    compiled = _Compiled(problem, w, lts, qs, ub, (r, u))
    _CACHE[key] = compiled
    return compiled


class LayerwiseWeights(NamedTuple):
    """One round's layer-wise weights.

    Attributes:
      weights: (groups, n) array, one simplex per group.
      groups: The group names.
      status: The solver's status (or the error).
      solve_time: Seconds in the solver.
      fallback: True when the solve failed and the weights are uniform.
      objective: The quadratic model's value at ``weights``.
    """

    weights: np.ndarray
    groups: tuple[str, ...]
    status: str
    solve_time: float
    fallback: bool
    objective: float


def solve_layerwise(
    qmats: np.ndarray,
    qs: np.ndarray,
    accepted: np.ndarray,
    *,
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    solver: str = DEFAULT_SOLVER,
    names: tuple[str, ...] = (),
) -> LayerwiseWeights:
    """Solve the layer-wise QP for (G, n, n) matrices and (G, n) vectors; uniform weights on failure.

    Args:
      qmats: (G, n, n) PSD matrices Q_l.
      qs: (G, n) vectors q_l.
      accepted: (n,) bool, the nodes that may get weight.
      lambda_reg: lambda >= 0, the pull towards the uniform weights u.
      max_weight: The cap on any node's weight in a group, or None for 1.
      solver: The cvxpy solver's name.
      names: The group names to report.

    Returns:
      The :class:`LayerwiseWeights`.

    Raises:
      ValueError: If no node is accepted or ``max_weight`` times the accepted count is below 1.
    """
    num_groups, n = qs.shape
    acc = np.asarray(accepted, bool)
    m = int(acc.sum())
    if m == 0:
        raise ValueError("layerwise_weights: no accepted node")
    cap = 1.0 if max_weight is None else float(max_weight)
    if cap * m < 1.0 - 1e-12:
        raise ValueError(f"layerwise_weights: max_weight={max_weight} < 1/{m} accepted nodes is infeasible")
    ub = np.where(acc, cap, 0.0)
    uniform = acc / m
    compiled = _build(num_groups, n, lambda_reg > 0)
    for g in range(num_groups):
        compiled.lt[g].value = factor_psd(qmats[g])
        compiled.q[g].value = qs[g]
    compiled.ub.value = ub
    if lambda_reg > 0:
        compiled.r[0].value = math.sqrt(lambda_reg)
        compiled.r[1].value = uniform
    start = time.perf_counter()
    status, fallback = "error", True
    w = np.tile(uniform, (num_groups, 1))
    try:
        compiled.problem.solve(solver=solver)
        status = compiled.problem.status
        if status in ("optimal", "optimal_inaccurate") and compiled.w.value is not None:
            raw = np.asarray(compiled.w.value)
            if np.all(np.isfinite(raw)):
                w = np.stack([project_capped_simplex(raw[g], np.zeros(n), ub) for g in range(num_groups)])
                fallback = False
    except Exception as e:  # cvxpy raises SolverError and friends; the round falls back to uniform
        status = f"error: {type(e).__name__}: {e}"
    elapsed = time.perf_counter() - start
    obj = float(sum(0.5 * w[g] @ qmats[g] @ w[g] + qs[g] @ w[g] for g in range(num_groups)))
    return LayerwiseWeights(w, tuple(names), status, elapsed, fallback, obj)


class LayerwiseState(NamedTuple):
    """State of :func:`layerwise_weights`.

    Attributes:
      info: The round's :class:`~consensus.base.AggregationInfo` (weights: the groups' mean).
      result: The round's :class:`LayerwiseWeights`, None before the first round.
    """

    info: AggregationInfo
    result: LayerwiseWeights | None = None


def layerwise_weights(
    model_fn: Callable[..., Any],
    *,
    groups: str | Callable[[str], str] | None = None,
    reference: str = "mean",
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    solver: str = DEFAULT_SOLVER,
) -> Aggregator:
    """Layer-wise convex merge weights (see the module docstring): one simplex per group of leaves.

    Each round: theta_0 = the uniform mean of the valid nodes (``reference="mean"``)
    or ``params`` (``"params"``); ``model_fn(theta_0, **extra)`` returns a
    :class:`consensus.convex.curvature.LossModel` (e.g. from
    :func:`consensus.softmax_gauss_newton` on the held-out batch given to
    ``update``); per group the statistics Q_l, q_l (one pass per leaf); the
    DPP problem; then leaf l is ``sum_i W[g(l), i] x_i`` (one pass).
    ``groups``: None/"leaf" (one simplex per leaf), "module" (per layer),
    "all" (task-wise) or a function of the leaf path. A solver failure falls
    back to uniform weights, reported in ``state.result``. Not jittable (cvxpy).
    ``state.info.weights`` is the mean of the groups' weights.

    Robustness: a node can take at most ``max_weight`` of any group (the cap,
    e.g. 1/(n - f)); the held-out loss decides the rest. DP sensitivity: 2C
    (every group's output is a convex combination of the nodes), like
    :func:`consensus.convex_merge`. Precondition: at least 1 valid node.

    Args:
      model_fn: ``model_fn(theta_0, **extra) -> LossModel``, the held-out loss model at the
        reference; ``extra`` are the keyword arguments given to ``update``.
      groups: ``None``/``"leaf"``, ``"module"``, ``"all"`` or a function of the leaf path.
      reference: ``"mean"`` (the valid nodes' uniform mean) or ``"params"``.
      lambda_reg: lambda >= 0, the pull towards the uniform weights.
      max_weight: The cap on any node's weight in a group, or None.
      solver: The cvxpy solver's name.

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`LayerwiseState`.

    Raises:
      ValueError: If ``reference`` or ``lambda_reg`` is invalid; from ``update``, when no node
        is valid or ``reference="params"`` lacks params.

    References:
      Yang, Wang, Shen, Liu, Guo, Wang and Tao 2024, ICLR, "AdaMerging: Adaptive Model Merging
      for Multi-Task Learning".
    """
    if reference not in ("mean", "params"):
        raise ValueError(f"layerwise_weights: reference must be 'mean' or 'params', got {reference!r}")
    if not (math.isfinite(lambda_reg) and lambda_reg >= 0):
        raise ValueError(f"layerwise_weights: lambda_reg must be >= 0, got {lambda_reg!r}")

    def init(params):
        del params
        return LayerwiseState(empty_info(), None)

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state
        n = tree.num_nodes(stacked)
        if params is not None:
            tree.check_stacked_against(stacked, params)
        valid = accepted_mask(mask, n) & np.asarray(tree.finite_mask(stacked))
        if not valid.any():
            raise ValueError(f"layerwise_weights: no valid node out of n={n}")
        if reference == "params":
            if params is None:
                raise ValueError("layerwise_weights: reference='params' needs params")
            ref = params
        else:
            ref = tree.weighted_sum(stacked, jnp.asarray(valid / valid.sum(), jnp.float32))
        lm = model_fn(ref, **extra)
        names = group_names(jax.tree.map(lambda x: x[0], stacked), groups)
        order = list(dict.fromkeys(names))
        qmats = np.zeros((len(order), n, n))
        qs = np.zeros((len(order), n))
        leaves = zip(
            *(jax.tree_util.tree_leaves(t) for t in (stacked, ref, lm.grad, lm.curvature)), strict=True
        )
        for name, (x, r, g, h) in zip(names, leaves, strict=True):
            keep = jnp.asarray(valid).reshape((n,) + (1,) * (x.ndim - 1))
            qm, q = _leaf_stats(jnp.where(keep, x, r[None]), r, g, h)
            k = order.index(name)
            qmats[k] += np.asarray(qm, np.float64)
            qs[k] += np.asarray(q, np.float64)
        result = solve_layerwise(
            qmats, qs, valid, lambda_reg=lambda_reg, max_weight=max_weight, solver=solver, names=tuple(order)
        )
        wj = jnp.asarray(result.weights, jnp.float32)
        outs = [
            _weighted(x, wj[order.index(name)])
            for name, x in zip(names, jax.tree_util.tree_leaves(stacked), strict=True)
        ]
        merged = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stacked), outs)
        mean_w = jnp.asarray(result.weights.mean(axis=0), jnp.float32)
        info = AggregationInfo(jnp.asarray(valid), jnp.asarray(valid), mean_w, False)
        return merged, LayerwiseState(info, result)

    return Aggregator(init, update, "layerwise_weights", lambda c, n: 2.0 * float(c))


def _weighted(x: jax.Array, w: jax.Array) -> jax.Array:
    from kernels import rows as row_kernels

    return row_kernels.weighted_sum(x, w).astype(x.dtype)
