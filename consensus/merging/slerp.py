"""Spherical interpolation: SLERP of two nodes, and the Karcher (multi-SLERP) mean of n."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators import view as views
from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.merging._common import (
    fixed_weights,
    info,
    leaves_of,
    node_weights,
    optimistic,
    require_stack,
    require_valid_count,
    unflatten_like,
)
from consensus.specs import RULES, at_least, exactly
from kernels import gram as gram_kernels
from kernels import rows as row_kernels
from kernels.compile_options import kernel_jit

PyTree = Any
ON = ("params", "deltas")
DOT_THRESHOLD = 0.9995  # mergekit's: above it, SLERP falls back to linear interpolation
EPS = 1e-8  # mergekit's normalization guard


class SphereState(NamedTuple):
    """State of :func:`slerp` and :func:`karcher_mean`.

    Attributes:
      info: The round's :class:`~consensus.base.AggregationInfo`.
      detail: Per-leaf diagnostics, a tree like params (SLERP's angle Omega per leaf).
    """

    info: AggregationInfo
    detail: PyTree = None


def _init(params):
    del params
    return SphereState(empty_info(), None)


def _prepare(rule: str, stacked, params, on: str):
    stacked = views.materialize(stacked) if views.is_view(stacked) else stacked
    n = tree.num_nodes(stacked)
    if on == "deltas":
        if params is None:
            raise ValueError(f"{rule}: on='deltas' needs the base model: update(stacked, state, params=base)")
        tree.check_stacked_against(stacked, params)
    elif params is not None:
        tree.check_stacked_against(stacked, params)
    return stacked, n


def slerp_coefficients(g: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Compute mergekit's SLERP coefficients from the 2 x 2 Gram matrix of the two vectors.

    Args:
      g: (2, 2) Gram matrix of v0 and v1.
      t: The interpolation parameter in [0, 1].

    Returns:
      ``(s0, s1, omega)``: the output is ``s0 v0 + s1 v1``; omega is the angle.
    """
    g = g.astype(jnp.float32)
    n0 = jnp.sqrt(jnp.maximum(g[0, 0], 0.0))
    n1 = jnp.sqrt(jnp.maximum(g[1, 1], 0.0))
    # mergekit divides by the norm only when it exceeds eps.
    d0 = jnp.where(n0 > EPS, n0, 1.0)
    d1 = jnp.where(n1 > EPS, n1, 1.0)
    dot = g[0, 1] / (d0 * d1)
    omega = jnp.arccos(jnp.clip(dot, -1.0, 1.0))
    sin_omega = jnp.sin(omega)
    linear = jnp.abs(dot) > DOT_THRESHOLD
    safe = jnp.where(linear, 1.0, sin_omega)
    s0 = jnp.where(linear, 1.0 - t, jnp.sin((1.0 - t) * omega) / safe)
    s1 = jnp.where(linear, t, jnp.sin(t * omega) / safe)
    return s0, s1, omega


@kernel_jit
def _slerp_leaf(x, ref, t, valid):
    # The two valid rows, in node order.
    idx = jnp.nonzero(valid, size=2, fill_value=0)[0]
    pair = x[idx]
    g = gram_kernels.gram(pair, ref)
    s0, s1, omega = slerp_coefficients(g, t)
    coeffs = jnp.zeros((x.shape[0],), jnp.float32).at[idx[0]].add(s0).at[idx[1]].add(s1)
    if ref is None:
        out = row_kernels.weighted_sum(x, coeffs)
    else:
        out = row_kernels.weighted_sum(x, coeffs, ref, 1.0 - s0 - s1)
    return out.astype(x.dtype), omega


@RULES.declare(
    kind="merge",
    precondition=exactly(2),
    sensitivity="not bounded",
    defaults={"t": 0.5},
    order_matters=True,  # SLERP(t) goes from the first node towards the second
)
def slerp(t: float, *, on: str = "params") -> Aggregator:
    r"""SLERP of two nodes (Shoemake 1985; mergekit's ``slerp``), leaf by leaf.

    On the flattened leaf, with v0 and v1 the two valid nodes in node order
    (``on="params"``, mergekit's convention: the raw parameters) or their task
    vectors ``x_i - params`` (``on="deltas"``, then the base is added back):

    .. math:: \cos\Omega = \frac{\langle v_0, v_1\rangle}{\lVert v_0\rVert\lVert v_1\rVert},\quad
              \text{slerp} = \frac{\sin((1-t)\Omega)}{\sin\Omega} v_0
              + \frac{\sin(t\Omega)}{\sin\Omega} v_1

    applied to the *unnormalized* vectors, as mergekit does; when
    ``|cos Omega| > 0.9995`` (nearly collinear) it is the linear interpolation
    ``(1 - t) v0 + t v1``. Norms at or below 1e-8 are not divided by (mergekit's
    guard). ``t = 0`` gives node 0, ``t = 1`` node 1: the output depends on
    the nodes' *order* (not permutation invariant: swapping the nodes is
    ``slerp(1 - t)``). ``state.detail`` holds the angle Omega per leaf.

    Precondition: exactly 2 valid nodes. DP sensitivity: not bounded.

    Args:
      t: The interpolation parameter in [0, 1] (0: node 0, 1: node 1).
      on: ``"params"`` (the raw parameters) or ``"deltas"`` (task vectors around ``params``).

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`SphereState`.

    Raises:
      ValueError: If ``t`` is outside [0, 1] or ``on`` unknown; from ``update``, when
        ``on="deltas"`` and the base is missing.
      ByzantineToleranceError: From ``update``, when there are not exactly 2 valid nodes.

    References:
      Shoemake 1985, SIGGRAPH, "Animating Rotation with Quaternion Curves".
    """
    if not 0.0 <= float(t) <= 1.0:
        raise ValueError(f"slerp: t must be in [0, 1], got {t!r}")
    if on not in ON:
        raise ValueError(f"slerp: on must be one of {ON}, got {on!r}")
    tt = jnp.float32(t)

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        stacked, n = _prepare("slerp", stacked, params, on)
        require_stack("slerp", exactly(2), n)

        def compute(valid):
            refs = (
                leaves_of(params)[0] if on == "deltas" else [None] * len(jax.tree_util.tree_leaves(stacked))
            )
            outs, angles = [], []
            for x, r in zip(leaves_of(stacked)[0], refs, strict=True):
                y, om = _slerp_leaf(x, r, tt, valid)
                outs.append(y)
                angles.append(om)
            return unflatten_like(stacked, outs), angles

        merged, angles, valid = optimistic(stacked, mask, n, assume_finite, compute, aux=True)
        require_valid_count("slerp", exactly(2), valid, n)
        w = jnp.where(jnp.cumsum(valid) == 1, 1.0 - tt, tt)
        return merged, SphereState(info(valid, w, False), unflatten_like(stacked, angles))

    return Aggregator(_init, update, "slerp")


@kernel_jit(static_argnames=("max_iter",))
def _karcher_leaf(x, ref, w, valid, tol, *, max_iter: int):
    """Karcher mean on the unit sphere in the coefficient space of the rows (via the Gram matrix)."""
    g = gram_kernels.gram(x, ref).astype(jnp.float32)
    g = jnp.where(valid[:, None] & valid[None, :], g, 0.0)
    norms = jnp.sqrt(jnp.maximum(jnp.diagonal(g), 0.0))
    use = valid & (norms > EPS) & (w > 0)
    wu = jnp.where(use, w, 0.0)
    wu = wu / jnp.maximum(jnp.sum(wu), 1e-30)
    inv = jnp.where(use, 1.0 / jnp.where(use, norms, 1.0), 0.0)
    # Unit vectors u_i = v_i / |v_i| are rows of U = diag(inv) in the basis of the v's; <a, b> = a G b.

    def normalize(c):
        nrm = jnp.sqrt(jnp.maximum(c @ g @ c, 0.0))
        return c / jnp.where(nrm > 0, nrm, 1.0)

    mu0 = normalize(wu * inv)

    def cond(carry):
        _, step, it = carry
        return (it < max_iter) & (step > tol)

    def body(carry):
        mu, _, it = carry
        cos = jnp.clip((inv[:, None] * g) @ mu, -1.0, 1.0)  # <u_i, mu>
        theta = jnp.arccos(cos)
        factor = jnp.where(theta > 1e-6, theta / jnp.sin(jnp.where(theta > 1e-6, theta, 1.0)), 1.0)
        # T = sum_i w_i factor_i (u_i - cos_i mu), in coefficients.
        tangent = jnp.diag(inv) @ (wu * factor) - jnp.sum(wu * factor * cos) * mu
        size = jnp.sqrt(jnp.maximum(tangent @ g @ tangent, 0.0))
        direction = tangent / jnp.where(size > 0, size, 1.0)
        new = normalize(jnp.cos(size) * mu + jnp.sin(size) * direction)
        return new, size, it + 1

    mu, step, iters = jax.lax.while_loop(cond, body, (mu0, jnp.float32(jnp.inf), jnp.int32(0)))
    coeffs = mu * jnp.sum(wu * norms)
    coeffs = jnp.where(use, coeffs, 0.0)
    if ref is None:
        out = row_kernels.weighted_sum(x, coeffs)
    else:
        out = row_kernels.weighted_sum(x, coeffs, ref, 1.0 - jnp.sum(coeffs))
    return out.astype(x.dtype), iters


@RULES.declare(kind="merge", precondition=at_least(1), sensitivity="not bounded")
def karcher_mean(
    max_iter: int = 100, tol: float = 1e-6, weights: Any = None, *, on: str = "params"
) -> Aggregator:
    r"""Karcher (Riemannian) mean on the sphere: SLERP for n nodes (mergekit's ``karcher``), leaf by leaf.

    With v_i the valid nodes' flattened leaves (``on="params"``) or task vectors
    (``on="deltas"``), unit vectors ``u_i = v_i / |v_i|`` and weights w
    normalized to sum 1, the direction mu minimizes ``sum_i w_i angle(mu, u_i)^2``
    (Karcher 1977; Buss and Fillmore 2001), found by the fixed-point iteration

    .. math:: T = \sum_i w_i \frac{\theta_i}{\sin\theta_i}(u_i - \cos\theta_i\,\mu),\quad
              \mu \leftarrow \cos\lVert T\rVert \mu + \sin\lVert T\rVert \frac{T}{\lVert T\rVert}

    from the normalized weighted mean of the u_i, until ``|T| <= tol`` or
    ``max_iter``; the output is ``mu * sum_i w_i |v_i|`` (the weighted mean
    norm), as in mergekit's ``karcher``. Every vector here lies in the span of
    the nodes, so the iteration runs on n coefficients with the leaf's Gram
    matrix (one Gram pass and one weighted-sum pass per leaf). Zero vectors
    are skipped. For two nodes with equal weights it is ``slerp(0.5)``.
    Permutation invariant. Precondition: at least 1 valid node.
    DP sensitivity: not bounded.

    Args:
      max_iter: The largest number of fixed-point iterations (>= 1).
      tol: The stopping tolerance on ``|T|`` (> 0).
      weights: (n,) non-negative node weights w, or None for 1 (normalized to sum 1).
      on: ``"params"`` (the raw parameters) or ``"deltas"`` (task vectors around ``params``).

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`SphereState`.

    Raises:
      ValueError: If ``on`` is unknown, ``max_iter`` < 1 or ``tol`` <= 0; from ``update``,
        when ``on="deltas"`` and the base is missing.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Karcher 1977, "Riemannian center of mass and mollifier smoothing"; Buss and Fillmore
      2001, ACM Transactions on Graphics, "Spherical Averages and Applications to Spherical
      Splines and Interpolation".
    """
    if on not in ON:
        raise ValueError(f"karcher_mean: on must be one of {ON}, got {on!r}")
    if int(max_iter) < 1 or not tol > 0:
        raise ValueError(f"karcher_mean: needs max_iter >= 1 and tol > 0, got {max_iter!r}, {tol!r}")
    fixed = fixed_weights("karcher_mean", weights)

    def update(stacked, state, params=None, *, mask=None, weights=None, assume_finite=False, **extra):
        del state, extra
        stacked, n = _prepare("karcher_mean", stacked, params, on)
        w = node_weights("karcher_mean", fixed, weights, n)

        def compute(valid):
            refs = (
                leaves_of(params)[0] if on == "deltas" else [None] * len(jax.tree_util.tree_leaves(stacked))
            )
            outs, iters = [], []
            for x, r in zip(leaves_of(stacked)[0], refs, strict=True):
                y, it = _karcher_leaf(x, r, w, valid, jnp.float32(tol), max_iter=int(max_iter))
                outs.append(y)
                iters.append(it)
            return unflatten_like(stacked, outs), iters

        merged, iters, valid = optimistic(stacked, mask, n, assume_finite, compute, aux=True)
        require_valid_count("karcher_mean", at_least(1), valid, n)
        return merged, SphereState(info(valid, w, False), unflatten_like(stacked, iters))

    return Aggregator(_init, update, "karcher_mean")
