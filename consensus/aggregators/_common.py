"""Plumbing shared by the aggregation rules: validity, centring, checks, state."""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.aggregators import view as views
from consensus.base import AggregationInfo, ByzantineToleranceError, empty_info, require
from consensus.specs import Precondition, least_count
from kernels import gram as gram_kernels
from kernels import sorting

PyTree = Any


class RuleState(NamedTuple):
    """State of a stateless rule: only the diagnostics of its last update."""

    info: AggregationInfo


def init_rule_state(params: PyTree = None) -> RuleState:
    del params
    return RuleState(info=empty_info())


def is_concrete(x: Any) -> bool:
    """True when x holds a value now (not a tracer inside an outer jit)."""
    return not isinstance(x, jax.core.Tracer)


def static_count(valid: jax.Array) -> int | None:
    """Number of valid nodes as a Python int, or None under an outer jit."""
    if is_concrete(valid):
        return int(np.sum(host_value(valid)))
    return None


def host_value(x: Any) -> np.ndarray:
    """A numpy copy of x, gathered from every process when x spans several (multi-host meshes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def check_stacked(stacked: PyTree, params: PyTree | None) -> int:
    """Validate the stacked tree or view (and params, if given); return n."""
    base = views.base_of(stacked)
    n = tree.num_nodes(base)
    if params is not None:
        tree.check_stacked_against(base, params)
    return n


def allowed(mask: jax.Array | None, n: int) -> jax.Array:
    if mask is None:
        return jnp.ones((n,), bool)
    mask = jnp.asarray(mask)
    if mask.shape != (n,):
        raise ValueError(f"mask must have shape (n,) = ({n},), got {mask.shape}")
    return mask.astype(bool)


def valid_nodes(stacked: PyTree, mask: jax.Array | None, assume_finite: bool = False) -> jax.Array:
    """(n,) bool: allowed by ``mask`` and, unless ``assume_finite``, finite in every leaf.

    A view knows its valid rows once a pre-aggregator has looked at them.
    """
    base = views.base_of(stacked)
    n = tree.num_nodes(base)
    valid = allowed(mask, n)
    if views.is_view(stacked) and stacked.valid is not None:
        return valid & stacked.valid
    if not assume_finite:
        finite = tree.finite_mask(base)
        if is_concrete(finite) and is_concrete(valid):
            allowed_count = int(np.sum(host_value(valid)))
            valid = valid & finite
            _last_validity.set((allowed_count, allowed_count - int(np.sum(host_value(valid)))))
        else:
            valid = valid & finite
    return valid


# (allowed nodes, of which non-finite) of the latest concrete validity computed in this context:
# a precondition that fails on no valid node then says whether NaN or Inf emptied the stack.
_last_validity: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "last_validity", default=None
)


def check_count(rule: str, precondition: Precondition, f: int, count: int | None) -> None:
    """Raise ByzantineToleranceError when the rule's declared precondition fails on ``count`` nodes.

    A rule calls it with the stack's n before it reads the nodes, and with the valid count m
    once validity is known: the one precondition its declaration names
    (:mod:`consensus.specs`), never a copy of it. Under an outer jit m is None: the check
    cannot run, and the rule's output is NaN instead when the precondition fails
    (:func:`too_few`, documented on each rule).
    """
    if count is None:
        return
    needed = precondition(count, f)
    try:
        require(rule, count, f, needed is None, needed or "")
    except ByzantineToleranceError as e:
        note = non_finite_note(count)
        if note:
            raise ByzantineToleranceError(f"{e}{note}") from None
        raise


def non_finite_note(count: int | None) -> str:
    """`` All k nodes hold NaN or Inf.`` when no node is valid because every allowed one is non-finite."""
    last = _last_validity.get()
    if count == 0 and last is not None and last[0] > 0 and last[1] == last[0]:
        return f" All {last[0]} nodes hold NaN or Inf."
    return ""


def too_few(precondition: Precondition, f: int, valid: jax.Array) -> jax.Array:
    """Scalar bool, traced: the valid count is below what the declared precondition needs."""
    least = least_count(precondition, f, valid.shape[0])
    return jnp.sum(valid.astype(jnp.int32)) < least


def nan_if(bad: jax.Array | None, merged: PyTree) -> PyTree:
    """Under an outer jit a failed precondition cannot raise: the output is NaN instead."""
    if bad is None:
        return merged
    return jax.tree.map(lambda y: jnp.where(bad, jnp.full_like(y, jnp.nan), y), merged)


def require_params(rule: str, params: PyTree | None) -> PyTree:
    if params is None:
        raise ValueError(f"{rule}: needs the current global params (the nodes' updates are x_i - params)")
    return params


def require_key(rule: str, key: jax.Array | None) -> jax.Array:
    if key is None:
        raise ValueError(f"{rule}: is randomized; pass a jax.random key as update(..., key=key)")
    return key


def top_eigenpair(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(largest eigenvalue, its unit eigenvector) of a symmetric PSD (n, n) matrix."""
    vals, vecs = jnp.linalg.eigh(h)
    return vals[-1], vecs[:, -1]


def check_f(rule: str, f: int) -> int:
    if not isinstance(f, (int, np.integer)) or isinstance(f, bool) or f < 0:
        raise ValueError(f"{rule}: num_byzantine must be a non-negative int, got {f!r}")
    return int(f)


def robust_centre(stacked: PyTree) -> PyTree:
    """Coordinate-wise median of the nodes (non-finite entries read as 0).

    Used as the Gram centre when no params are given: it sits inside the honest
    cluster whenever fewer than half the nodes are outliers, which is what keeps
    the distance computation free of cancellation.
    """

    def leaf(x):
        safe = jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
        return sorting.median(safe).astype(x.dtype)

    return jax.tree.map(leaf, stacked)


class GramStats(NamedTuple):
    gram: jax.Array  # (n, n), invalid rows/cols zeroed
    sq_dists: jax.Array  # (n, n), +inf at invalid pairs
    valid: jax.Array  # (n,)
    centre: PyTree


def gram_stats(stacked: PyTree, params: PyTree | None, mask: jax.Array | None) -> GramStats:
    """Gram matrix centred on params (or, without params, on the nodes' mean), and validity from its diagonal.

    A node whose leaves hold NaN/Inf (or overflow float32 when squared) has a
    non-finite diagonal entry, so no separate finiteness pass is needed. For a
    view the Gram matrix of its rows is ``A G A^T`` (cached by the view when a
    pre-aggregator already formed it), centred on the view's centre.

    Without params the Gram matrix is centred on the mean of the allowed nodes,
    formed inside the same single pass (``kernels.gram.gram_self_centred``; its
    docstring says why the mean keeps distances accurate). That centre is not
    returned (``centre`` is None): it serves distances and combinations whose
    coefficients sum to 1, which do not depend on it. A non-finite node spoils
    the mean, so when some allowed node comes out invalid the matrix is formed
    again on the coordinate-wise median (a ``lax.cond`` under an outer jit: the
    second pass only runs then).
    """
    if views.is_view(stacked):
        return _view_gram_stats(stacked, mask)
    n = tree.num_nodes(stacked)
    allow = allowed(mask, n)
    if params is not None:
        g = tree.gram(stacked, params)
        return _finish_stats(g, allow & jnp.isfinite(jnp.diagonal(g)), params)

    def robust():
        g = tree.gram(stacked, robust_centre(stacked))
        return g, allow & jnp.isfinite(jnp.diagonal(g))

    g = _sum_over_leaves(gram_kernels.gram_self_centred(x, allow) for x in jax.tree_util.tree_leaves(stacked))
    valid = allow & jnp.isfinite(jnp.diagonal(g))
    every_allowed_finite = jnp.all(valid == allow)
    if is_concrete(every_allowed_finite):
        if not bool(every_allowed_finite):
            g, valid = robust()
    else:
        g, valid = jax.lax.cond(every_allowed_finite, lambda: (g, valid), robust)
    return _finish_stats(g, valid, None)


def _sum_over_leaves(grams) -> jax.Array:
    total = None
    for g in grams:
        total = g if total is None else total + g
    assert total is not None, "a tree without leaves has no Gram matrix"
    return total


def medoid(sq_dists: jax.Array, valid: jax.Array) -> jax.Array:
    """Index of the valid node with the smallest sum of distances to the other valid nodes (lowest on ties).

    A robust point of the data (breakdown 1/2, like the coordinate-wise
    median) that costs n x n work: centered clipping starts from it when no
    params are given.
    """
    dist = jnp.sqrt(jnp.where(valid[:, None] & valid[None, :], sq_dists, 0.0))
    return jnp.argmin(jnp.where(valid, jnp.sum(dist, axis=1), jnp.inf))


def recentre_gram(g: jax.Array, r: jax.Array) -> jax.Array:
    """The Gram matrix of the same rows centred on row r: G_ij - G_ir - G_rj + G_rr."""
    gr = g[r]
    return g - gr[None, :] - gr[:, None] + g[r, r]


def under_outer_jit(stacked: PyTree, mask: jax.Array | None) -> bool:
    """True when the stack or the mask is traced (the update runs inside a user's jit)."""
    leaves = jax.tree_util.tree_leaves(views.base_of(stacked))
    return not all(is_concrete(x) for x in leaves) or (mask is not None and not is_concrete(mask))


def all_finite(tree_: PyTree) -> jax.Array:
    """Scalar bool: every entry of every leaf is finite (reads the output, 1/n of the stack).

    As ``isfinite(sum(y * 0))``: y * 0 is NaN exactly where y is NaN or +-Inf, and a
    float sum vectorizes where a boolean ``all`` does not on XLA:CPU, so under jit the
    check stays small beside the rule. The one formula lives in
    :func:`consensus.tree.is_finite`.
    """
    return tree.is_finite(tree_)


def unless_non_finite(value: tuple, fallback, check: int = 0) -> tuple:
    """``value`` when its element ``check`` (a tree; the first by default) is finite, else ``fallback()``.

    ``value = (merged, ...)`` is the optimistic result of a rule, already computed. A
    ``lax.cond(all_finite(merged), lambda: value, fallback)`` would be the obvious form,
    but XLA gives a conditional its own output buffer, so the branch that returns the
    precomputed ``merged`` copies it: a fresh output-sized buffer written on every call,
    which would make mean and median slower under a user's jit than eagerly. A while loop carries ``value`` in
    place instead: its condition is the finiteness check, and its body (the fallback)
    runs at most once. The body's ``lax.cond`` on the loop-carried flag makes the
    fallback depend on the loop state; without it XLA's loop-invariant code motion
    hoists the fallback's passes over the stack out of the loop, running them always.
    Not reverse-differentiable (a while loop); no rule is differentiated through.
    """

    def still_to_replace(carry):
        current, replaced = carry
        return ~replaced & ~all_finite(current[check])

    def replace(carry):
        current, replaced = carry
        return jax.lax.cond(replaced, lambda: current, fallback), jnp.bool_(True)

    return jax.lax.while_loop(still_to_replace, replace, (tuple(value), jnp.bool_(False)))[0]


def _view_gram_stats(v, mask) -> GramStats:
    n = tree.num_nodes(v.base)
    if v.gram is not None:
        g, valid = v.gram, v.valid
    else:
        g = tree.gram(v.base, v.centre)
        valid = jnp.isfinite(jnp.diagonal(g))
        if v.valid is not None:
            valid = valid & v.valid
        if v.mixing is not None:
            g = jnp.where(valid[:, None] & valid[None, :], g, 0.0)
            g = v.mixing @ g @ v.mixing.T
            valid = valid & jnp.any(v.mixing != 0, axis=1)
    return _finish_stats(g, allowed(mask, n) & valid, v.centre)


def _finish_stats(g, valid, centre) -> GramStats:
    both = valid[:, None] & valid[None, :]
    g = jnp.where(both, g, 0.0)
    d2 = jnp.where(both, gram_kernels.sq_dists_from_gram(g), jnp.inf)
    return GramStats(g, d2, valid, centre)


def uniform_over(mask: jax.Array) -> jax.Array:
    m = jnp.sum(mask.astype(jnp.float32))
    return mask.astype(jnp.float32) / jnp.maximum(m, 1.0)


def coordinatewise(kernel, stacked: PyTree, **kwargs) -> PyTree:
    """Apply a per-leaf coordinate-wise kernel to a stacked tree or a view.

    ``kernel(x_leaf, mixing=..., centre=..., diagonal=..., **kwargs)`` returns
    the float32 result for that leaf; it is cast back to the leaf's dtype.
    """
    leaves, centres, mixing, diagonal = views.leaf_inputs(stacked)
    out = []
    for x, c in zip(leaves, centres, strict=True):
        if mixing is None:
            y = kernel(x, **kwargs)
        else:
            y = kernel(x, mixing=mixing, centre=c, diagonal=diagonal, **kwargs)
        out.append(y.astype(x.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(views.base_of(stacked)), out)
