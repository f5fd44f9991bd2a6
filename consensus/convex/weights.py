"""Convex merge weights: simplex weights over the nodes from a convex problem.

Three objectives, each a cvxpy problem compiled once (see
:mod:`consensus.convex.problems`) and re-solved through Parameters:

* :func:`quadratic_weights`: a quadratic model of the held-out loss of the
  merged parameters around a reference point;
* :func:`mixture_nll_weights`: the negative log-likelihood of the mixture of the
  nodes' predictive distributions on held-out data (stacking);
* :func:`anchor_weights`: the merged point closest to a robust anchor.

All three share the feasible set and options::

    W = {w : sum_i w_i = 1, lb_i <= w_i <= ub_i},
    ub_i = max_weight * a_i,  lb_i = min_weight * a_i,  a_i = 1 if node i is accepted

plus an optional ridge ``lambda_reg * ||w - u||^2`` towards the uniform weights
u over the accepted nodes. Infeasible options raise ValueError before any
solve. A solver failure (exception, bad status, non-finite point) returns the
uniform weights over the accepted nodes with ``fallback=True`` and the reason
in ``message``; weights are never NaN. The solver's point is projected onto W
(Euclidean, by bisection), so the returned weights satisfy the constraints to
rounding even when the solver stops at its tolerance.

Statistics come from the stacked tree leaf by leaf (Gram matrices of deltas,
matrix-vector products), summed over leaves in float64; parameters are never
flattened into one vector.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.convex.problems import (
    DEFAULT_SOLVER,
    ProblemCache,
    accepted_mask,
    check_options,
    uniform_weights,
)
from consensus.convex.qp import ConvexWeights, solve_qp_weights
from kernels import gram as gram_kernels

PyTree = Any
HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- tree statistics


def _check_like(name: str, t: PyTree, ref: PyTree) -> None:
    t_leaves, t_def = jax.tree_util.tree_flatten(t)
    r_leaves, r_def = jax.tree_util.tree_flatten(ref)
    if t_def != r_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub declares no __ne__
        raise tree.TreeMismatchError(f"{name} has a different tree structure from the reference params")
    for path, a, b in zip(tree.leaf_paths(ref), r_leaves, t_leaves, strict=True):
        if np.shape(a) != np.shape(b):
            raise tree.TreeMismatchError(
                f"{name}, leaf {path}: shape {np.shape(b)} != params shape {np.shape(a)}"
            )


def _check_finite_tree(name: str, t: PyTree, *, nonneg: bool = False) -> None:
    for path, x in zip(tree.leaf_paths(t), jax.tree_util.tree_leaves(t), strict=True):
        arr = np.asarray(x, np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name}, leaf {path}: holds NaN or Inf")
        if nonneg and np.any(arr < 0):
            raise ValueError(f"{name}, leaf {path}: a curvature must be >= 0, found min {arr.min():g}")


@jax.jit
def _scaled_delta_gram(x: jax.Array, ref: jax.Array, h: jax.Array) -> jax.Array:
    # Centre first, then scale: (x - ref) is exact-ish for close nodes; scaling
    # before centring would cancel like raw-parameter Grams do.
    s = jnp.sqrt(h.astype(jnp.float32))
    d = (x.astype(jnp.float32) - ref.astype(jnp.float32)[None]) * s[None]
    return gram_kernels.gram(d)


@jax.jit
def _delta_dot(x: jax.Array, ref: jax.Array, v: jax.Array) -> jax.Array:
    n = x.shape[0]
    d = (x.astype(jnp.float32) - ref.astype(jnp.float32)[None]).reshape(n, -1)
    return jnp.dot(d, v.astype(jnp.float32).reshape(-1), precision=HIGHEST)


def quadratic_statistics(
    stacked: PyTree, ref: PyTree, grad: PyTree, curvature: PyTree
) -> tuple[np.ndarray, np.ndarray]:
    r"""Compute (Q, q) of the quadratic model, leaf by leaf, summed in float64.

    .. math:: Q = D H D^T = \sum_{leaves} G((x - \theta_0) \sqrt h),\qquad q = D g

    where row i of D is node i's delta ``x_i - theta_0`` and ``H = diag(h)``.

    Args:
      stacked: Stacked tree of the n nodes' parameters.
      ref: The reference point theta_0, a tree like one node.
      grad: The gradient g at ``ref``, a tree like ``ref``.
      curvature: The diagonal curvature h >= 0 at ``ref``, a tree like ``ref``.

    Returns:
      ``(Q, q)``: (n, n) and (n,) float64 numpy arrays.
    """
    tree.check_stacked_against(stacked, ref)
    _check_like("grad", grad, ref)
    _check_like("curvature", curvature, ref)
    n = tree.num_nodes(stacked)
    qmat = np.zeros((n, n))
    q = np.zeros(n)
    for x, r, g, h in zip(
        *(jax.tree_util.tree_leaves(t) for t in (stacked, ref, grad, curvature)), strict=True
    ):
        qmat += np.asarray(_scaled_delta_gram(x, r, h), np.float64)
        q += np.asarray(_delta_dot(x, r, g), np.float64)
    return qmat, q


def _masked_mean(stacked: PyTree, acc: np.ndarray) -> PyTree:
    w = jnp.asarray(acc.astype(np.float32) / acc.sum())
    return tree.weighted_sum(stacked, w)


def _combined_mask(stacked: PyTree, mask: Any) -> np.ndarray:
    n = tree.num_nodes(stacked)
    return accepted_mask(mask, n) & np.asarray(tree.finite_mask(stacked))


# ----------------------------------------------------------------------------- objectives


def quadratic_weights(
    stacked: PyTree,
    ref: PyTree,
    grad: PyTree,
    curvature: PyTree,
    *,
    loss: float = 0.0,
    damping: float = 0.0,
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    min_weight: float = 0.0,
    mask: Any = None,
    solver: str = DEFAULT_SOLVER,
    cache: ProblemCache | None = None,
    solver_options: dict[str, Any] | None = None,
) -> ConvexWeights:
    r"""Weights minimizing a quadratic model of the held-out loss of the merge.

    With ``theta(w) = sum_i w_i x_i`` and ``sum_i w_i = 1``,
    ``theta(w) - theta_0 = D^T w`` (rows of D: the deltas ``x_i - theta_0``), so

    .. math:: L(\theta(w)) \approx L_0 + (D g)^T w + \tfrac12 w^T D (H + \delta I) D^T w

    with g the held-out gradient and ``H = diag(h) >= 0`` a diagonal Fisher or
    Gauss-Newton curvature at theta_0 (see :mod:`consensus.convex.curvature`).
    An n-dimensional QP; the n x n matrix is a Gram matrix of the scaled deltas.

    Args:
      stacked: stacked tree of the n nodes' parameters.
      ref: the reference point theta_0 (the uniform or a robust mean of the
        nodes, or the current global params), a tree like one node.
      grad: gradient of the held-out loss at ``ref``, a tree like ``ref``.
      curvature: diagonal curvature h >= 0 at ``ref``, a tree like ``ref``.
      loss: held-out loss at ``ref`` (only shifts the reported objective).
      damping: delta >= 0 added to h (a trust-region-like damping).
      lambda_reg: lambda >= 0, the ridge ``lambda ||w - u||^2`` towards the uniform weights u
        over the accepted nodes.
      max_weight: The cap on every weight, in (0, 1], or None for no cap (1).
      min_weight: The floor on every accepted node's weight, in [0, 1].
      mask: (n,) bool of the nodes allowed a positive weight, or None for all.
      solver: An installed cvxpy solver's name; Clarabel by default.
      cache: The problem cache (default: the process-wide one).
      solver_options: Keyword arguments for ``problem.solve``.
        Nodes holding NaN/Inf are rejected on top of ``mask``.

    Returns:
      :class:`ConvexWeights`; ``objective`` is the predicted held-out loss.

    Raises:
      ValueError: If the options are out of range or infeasible (see :func:`solve_qp_weights`).

    Example:
      >>> from consensus import softmax_gauss_newton, stack
      >>> def logits_fn(p, x): return x @ p["w"]
      >>> ref = {"w": jnp.zeros((2, 2))}
      >>> stacked = stack([{"w": s * jnp.eye(2)} for s in (1.0, 2.0, -3.0)])  # node 2 is wrong
      >>> model = softmax_gauss_newton(logits_fn, ref, jnp.eye(2), jnp.array([0, 1]))
      >>> res = quadratic_weights(stacked, ref, model.grad, model.curvature, loss=float(model.loss),
      ...                         max_weight=0.75)
      >>> res.status, bool(res.weights[2] < 1e-6), bool(abs(res.weights.sum() - 1.0) < 1e-6)
      ('optimal', True, True)

    References:
      Matena & Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022.
    """
    if not (math.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    acc = _combined_mask(stacked, mask)
    _check_finite_tree("ref", ref)
    _check_finite_tree("grad", grad)
    _check_finite_tree("curvature", curvature, nonneg=True)
    if damping > 0:
        curvature = jax.tree.map(lambda h: h + jnp.asarray(damping, jnp.result_type(h)), curvature)
    qmat, q = quadratic_statistics(stacked, ref, grad, curvature)
    return solve_qp_weights(
        qmat,
        q,
        float(loss),
        objective_name="quadratic",
        lambda_reg=lambda_reg,
        max_weight=max_weight,
        min_weight=min_weight,
        mask=acc,
        solver=solver,
        cache=cache,
        solver_options=solver_options,
    )


def trust_region_quadratic_weights(
    stacked: PyTree,
    ref: PyTree,
    grad: PyTree,
    curvature: PyTree,
    loss_at: Callable[[PyTree], float],
    *,
    loss: float = 0.0,
    eta: float = 0.1,
    max_steps: int = 8,
    damping: float = 0.0,
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    min_weight: float = 0.0,
    mask: Any = None,
    solver: str = DEFAULT_SOLVER,
    cache: ProblemCache | None = None,
    solver_options: dict[str, Any] | None = None,
) -> ConvexWeights:
    r"""Quadratic-model weights, safeguarded by the true held-out loss (a trust region).

    The quadratic model is only trusted near its reference point; far from it
    (a vertex of the simplex, for a non-convex network) it can promise a loss
    the merge does not have. As in Levenberg-Marquardt, the ridge towards
    uniform weights u is the trust region: solve :func:`quadratic_weights` with
    ridge lambda, evaluate the true held-out loss L of the merge, and accept
    when

    .. math:: \rho = \frac{L(\theta(u)) - L(\theta(w))}{m(u) - m(w)} \ge \eta

    (m the quadratic model); otherwise ``lambda <- max(10 lambda, 0.01 |Q|)``
    and re-solve (a DPP re-solve: only Parameters change). Accepted weights
    never have a higher held-out loss than the uniform merge; after
    ``max_steps`` rejections the uniform weights are returned (and the
    message says so).

    Args:
      stacked: Stacked tree of the n nodes' parameters.
      ref: The reference point theta_0, a tree like one node.
      grad: The gradient of the held-out loss at ``ref``.
      curvature: The diagonal curvature h >= 0 at ``ref``.
      loss_at: ``loss_at(params) -> float``, the held-out loss of a tree like
        ``ref`` (for example ``lambda p: float(model_fn(p).loss)``).
      loss: The held-out loss at ``ref`` (only shifts the reported objective).
      eta: acceptance threshold on rho, in (0, 1).
      max_steps: how many times the ridge may grow.
      damping: delta >= 0 added to h.
      lambda_reg: lambda >= 0, the ridge ``lambda ||w - u||^2`` towards the uniform weights u;
        the first ridge tried.
      max_weight: The cap on every weight, in (0, 1], or None for no cap (1).
      min_weight: The floor on every accepted node's weight, in [0, 1].
      mask: (n,) bool of the nodes allowed a positive weight, or None for all.
      solver: An installed cvxpy solver's name; Clarabel by default.
      cache: The problem cache (default: the process-wide one).
      solver_options: Keyword arguments for ``problem.solve``.

    Returns:
      :class:`ConvexWeights`; ``iterations`` counts the solves, ``message``
      gives the accepted lambda, rho and held-out losses.

    Raises:
      ValueError: If the options are out of range or infeasible (see :func:`solve_qp_weights`).

    References:
      Nocedal & Wright, "Numerical Optimization", ch. 4 (trust regions), 2006.
    """
    if not (0 < eta < 1):
        raise ValueError(f"eta must be in (0, 1), got {eta!r}")
    if max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps!r}")
    if not (math.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    check_options(lambda_reg, max_weight, min_weight)
    acc = _combined_mask(stacked, mask)
    _check_finite_tree("ref", ref)
    _check_finite_tree("grad", grad)
    _check_finite_tree("curvature", curvature, nonneg=True)
    if damping > 0:
        curvature = jax.tree.map(lambda h: h + jnp.asarray(damping, jnp.result_type(h)), curvature)
    qmat, q = quadratic_statistics(stacked, ref, grad, curvature)
    keep = np.outer(acc, acc)
    qz, qv = np.where(keep, qmat, 0.0), np.where(acc, q, 0.0)
    u = uniform_weights(acc)

    def model(w: np.ndarray) -> float:
        return float(loss + qv @ w + 0.5 * w @ qz @ w)

    def merged(w: np.ndarray) -> PyTree:
        return tree.weighted_sum(stacked, jnp.asarray(w, jnp.float32))

    loss_u = float(loss_at(merged(u)))
    scale = max(float(np.max(np.abs(qz))), 1e-300)
    lam = float(lambda_reg)
    total_time = 0.0
    res = None
    for step in range(max_steps + 1):
        res = solve_qp_weights(
            qmat,
            q,
            float(loss),
            objective_name="quadratic",
            lambda_reg=lam,
            max_weight=max_weight,
            min_weight=min_weight,
            mask=acc,
            solver=solver,
            cache=cache,
            solver_options=solver_options,
        )
        total_time += res.solve_time
        if res.fallback:
            return res
        w = res.weights
        predicted = model(u) - model(w)
        if predicted <= 1e-12 * max(1.0, abs(loss_u)):
            note = f"trust region: the model predicts no gain over uniform weights (lambda={lam:.3g})"
            return _replace(res, solve_time=total_time, message=note, iterations=step + 1)
        loss_w = float(loss_at(merged(w)))
        rho = (loss_u - loss_w) / predicted
        if rho >= eta and loss_w <= loss_u:
            note = (
                f"trust region: accepted lambda={lam:.3g}, rho={rho:.3f}, held-out loss {loss_w:.6g} "
                f"(uniform {loss_u:.6g})"
            )
            return _replace(res, solve_time=total_time, message=note, iterations=step + 1)
        lam = max(10.0 * lam, 0.01 * scale)
    note = (
        f"trust region: no step with rho >= {eta} in {max_steps + 1} solves (last lambda={lam / 10:.3g}); "
        "uniform weights"
    )
    assert res is not None  # the loop above ran at least once
    return _replace(
        res, weights=u, objective=model(u), solve_time=total_time, message=note, iterations=max_steps + 1
    )


def _replace(res: ConvexWeights, **changes: Any) -> ConvexWeights:
    return dataclasses.replace(res, **changes)


def anchor_weights(
    stacked: PyTree,
    anchor: PyTree | None = None,
    *,
    anchor_node_weights: Any = None,
    ref: PyTree | None = None,
    lambda_reg: float = 0.0,
    max_weight: float | None = None,
    min_weight: float = 0.0,
    mask: Any = None,
    solver: str = DEFAULT_SOLVER,
    cache: ProblemCache | None = None,
    solver_options: dict[str, Any] | None = None,
) -> ConvexWeights:
    r"""Weights whose merged point is closest to a robust anchor.

    .. math:: \min_{w \in W} \|D^T w - (a - \theta_0)\|^2 = w^T G w - 2 b^T w + c

    Give the anchor either as a tree ``anchor`` (e.g. the trimmed mean): then
    theta_0 = a, so G is the Gram matrix of the deltas from the anchor and
    b = 0, c = 0 (centring on the anchor keeps G accurate); or as weights
    ``v`` over the nodes (``anchor_node_weights``, e.g. Weiszfeld's weights of
    the geometric median, ``a = sum_i v_i x_i``): then b = G v and c = v^T G v
    with G centred on ``ref`` (default: the uniform mean of the accepted
    nodes). Without caps or floors the answer is v itself; caps make it the
    closest capped merge.

    Args:
      stacked: stacked tree of the n nodes.
      anchor: the anchor as a tree like one node, or None.
      anchor_node_weights: (n,) nonnegative weights summing to 1, zero on
        rejected nodes, or None. Exactly one of ``anchor`` and this is given.
      ref: centring point for the node-weights form.
      lambda_reg: lambda >= 0, the ridge ``lambda ||w - u||^2`` towards the uniform weights u
        over the accepted nodes.
      max_weight: The cap on every weight, in (0, 1], or None for no cap (1).
      min_weight: The floor on every accepted node's weight, in [0, 1].
      mask: (n,) bool of the nodes allowed a positive weight, or None for all.
      solver: An installed cvxpy solver's name; Clarabel by default.
      cache: The problem cache (default: the process-wide one).
      solver_options: Keyword arguments for ``problem.solve``.

    Returns:
      :class:`ConvexWeights`; ``objective`` is the squared distance to the anchor
      (plus the ridge).

    Raises:
      ValueError: If not exactly one of ``anchor`` and ``anchor_node_weights`` is given, or
        the options are out of range or infeasible.

    Example:
      >>> from consensus import stack
      >>> stacked = stack([{"w": jnp.array([x])} for x in (0.0, 2.0, 4.0, 100.0)])
      >>> res = anchor_weights(stacked, anchor={"w": jnp.array([1.0])}, max_weight=0.75)
      >>> merged = float(res.weights @ np.array([0.0, 2.0, 4.0, 100.0]))
      >>> round(merged, 3)  # the anchor is a convex combination under the cap: it is hit exactly
      1.0

    References:
      Pillutla, Kakade & Harchaoui, "Robust Aggregation for Federated Learning" (RFA), 2022.
    """
    if (anchor is None) == (anchor_node_weights is None):
        raise ValueError("give exactly one of anchor (a tree) and anchor_node_weights (an (n,) vector)")
    n = tree.num_nodes(stacked)
    acc = _combined_mask(stacked, mask)
    opts = dict(
        objective_name="anchor",
        lambda_reg=lambda_reg,
        max_weight=max_weight,
        min_weight=min_weight,
        mask=acc,
        solver=solver,
        cache=cache,
        solver_options=solver_options,
    )
    if anchor is not None:
        tree.check_stacked_against(stacked, anchor)
        _check_finite_tree("anchor", anchor)
        g = tree.gram_f64(stacked, anchor)
        return solve_qp_weights(2.0 * g, np.zeros(n), 0.0, **opts)
    v = np.asarray(anchor_node_weights, np.float64)
    if v.shape != (n,):
        raise ValueError(f"anchor_node_weights must have shape ({n},), got {v.shape}")
    if not np.all(np.isfinite(v)) or np.any(v < 0) or abs(v.sum() - 1.0) > 1e-5:
        raise ValueError(
            "anchor_node_weights must be finite, >= 0 and sum to 1 "
            f"(got sum {v.sum():.6g}, min {v.min():.3g})"
        )
    if np.any(v[~acc] != 0):
        raise ValueError(
            f"anchor_node_weights put weight on rejected nodes {np.flatnonzero((v != 0) & ~acc).tolist()}"
        )
    v = v / v.sum()
    if ref is None:
        ref = _masked_mean(stacked, acc)
    else:
        tree.check_stacked_against(stacked, ref)
    g = tree.gram_f64(stacked, ref)
    g = np.where(np.outer(acc, acc), g, 0.0)
    b = g @ v
    return solve_qp_weights(2.0 * g, -2.0 * b, float(v @ b), **opts)
