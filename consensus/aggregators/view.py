"""Lazy linear views of a stacked tree: pre-aggregators that never materialize.

Clipping and nearest-neighbour mixing are linear maps of the nodes: with a
centre c, their output rows are ``y_i = c + sum_j A[i, j] (x_j - c)``. Writing
those n rows out costs a full copy of the stack, and on XLA:CPU a fresh
stack-sized output costs several passes over memory in page faults alone. A
:class:`NodeView` keeps ``(x, A, c)`` instead, and every rule reads it
through the helpers below:

* Gram matrix of y (centred on c): ``A G_x A^T``, n x n work, cached in the view;
* a weighted sum of y: one pass over x with weights ``A^T w``;
* coordinate-wise rules build the rows of y inside their fused kernel.

So ``process(krum(f), pre=(clip(C), nnm(f)))`` reads the parameters twice in
all: one Gram pass and one weighted-sum pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp

from consensus import tree

PyTree = Any


class NodeView(NamedTuple):
    """Rows ``y_i = c + sum_j A[i, j] (x_j - c)`` of a stacked tree x, not materialized.

    Attributes:
      base: the stacked tree x (n rows).
      mixing: (n, n) A, or None for the identity.
      centre: the tree c (no node axis), or None for 0.
      valid: (n,) bool rows of y that exist, or None when not computed yet.
      gram: cached (n, n) Gram matrix of y centred on c (invalid rows zeroed), or None.
      diagonal: static; True when A is diagonal (clipping only), which makes
        building a row of y one multiply-add instead of n.
      floating: True when the rows need no centre (c is None and every valid row of
        A sums to 1, as after nearest-neighbour mixing without params) and ``gram``
        is centred on a point that is not kept (the nodes' mean, formed inside the
        Gram pass). Such a Gram matrix gives distances and combinations whose
        coefficients sum to 1, not the norms around 0 that clipping needs.
    """

    base: PyTree
    mixing: jax.Array | None = None
    centre: PyTree | None = None
    valid: jax.Array | None = None
    gram: jax.Array | None = None
    diagonal: bool = True
    floating: bool = False


class DroppedRows(NamedTuple):
    """DARE's rows ``y_i = c + factor * keep_i * (x_i - c)``, not materialized (see :mod:`kernels.dropout`).

    ``keep_i`` is a pure function of the leaf's key, so a consumer that knows this type
    (task arithmetic) sums the dropped task vectors in one read of x; every other
    consumer gets the rows written out (:func:`materialize`).

    Attributes:
      base: the stacked tree x (n rows).
      centre: the base model c (no node axis).
      keys: one key per leaf of x (its leaf order).
      density: float32 scalar, the keep probability.
      factor: float32 scalar, the rescale of the kept entries.
      valid: (n,) bool rows that exist (the others come out NaN).
    """

    base: PyTree
    centre: PyTree
    keys: tuple[jax.Array, ...]
    density: jax.Array
    factor: jax.Array
    valid: jax.Array


def is_view(x: Any) -> TypeGuard[NodeView]:
    """Tell whether ``x`` is a lazy :class:`NodeView` (rather than a stacked tree).

    Args:
      x: A stacked tree, a view or anything else.

    Returns:
      True for a :class:`NodeView`.
    """
    return isinstance(x, NodeView)


def is_dropped(x: Any) -> TypeGuard[DroppedRows]:
    """Tell whether ``x`` is DARE's lazy :class:`DroppedRows`.

    Args:
      x: A stacked tree, a view or anything else.

    Returns:
      True for a :class:`DroppedRows`.
    """
    return isinstance(x, DroppedRows)


def base_of(x: PyTree | NodeView) -> PyTree:
    """Return the stacked tree a view reads (x itself when it is not a view).

    Args:
      x: A stacked tree or a :class:`NodeView`.

    Returns:
      The base stack x.
    """
    return x.base if is_view(x) else x


def identity(stacked: PyTree, centre: PyTree | None) -> NodeView:
    """Return the identity view of ``stacked`` around ``centre`` (A = I, diagonal, nothing cached).

    Args:
      stacked: The stacked tree x.
      centre: The centre c (no node axis), or None for 0.

    Returns:
      A :class:`NodeView` whose rows are the nodes themselves.
    """
    return NodeView(stacked, None, centre, None, None, True)


def compose(
    view: NodeView, mixing: jax.Array, *, diagonal: bool, gram: jax.Array | None, valid: jax.Array
) -> NodeView:
    """Return the view of ``z_i = c + sum_k M[i, k] (y_k - c)`` where y is ``view``.

    Args:
      view: The view y.
      mixing: (n, n) matrix M applied after the view's own A (the result holds M A).
      diagonal: Whether M is diagonal.
      gram: The Gram matrix of z around c, when known (cached), else None.
      valid: (n,) bool, the rows of z that exist.

    Returns:
      The composed :class:`NodeView`.
    """
    total = mixing if view.mixing is None else mixing @ view.mixing
    return NodeView(view.base, total, view.centre, valid, gram, view.diagonal and diagonal, view.floating)


def with_norms(view: NodeView) -> NodeView:
    """Return the view with a Gram matrix whose diagonal holds the norms around its centre.

    A floating view's Gram matrix is centred elsewhere (see :class:`NodeView`): it is
    dropped, so the next Gram pass forms the one around the view's centre.

    Args:
      view: A :class:`NodeView`.

    Returns:
      The view itself, or, when floating, the view without its cached Gram matrix.
    """
    return view._replace(gram=None, floating=False) if view.floating else view


def weighted_sum(x: PyTree | NodeView, weights: jax.Array) -> PyTree:
    """Return ``sum_i w_i y_i`` in one pass over the base stack.

    Args:
      x: A stacked tree or a :class:`NodeView` (rows y).
      weights: (n,) weights w.

    Returns:
      One tree (no node axis).
    """
    if not is_view(x):
        return tree.weighted_sum(x, weights)
    if x.mixing is None:
        return (
            tree.weighted_sum(x.base, weights)
            if x.centre is None
            else tree.combine(x.base, weights, x.centre, total=jnp.sum(weights))
        )
    b = x.mixing.T @ weights
    if x.centre is None:
        return tree.weighted_sum(x.base, b)
    return tree.combine(x.base, b, x.centre, total=jnp.sum(weights))


def combine(x: PyTree | NodeView, coeffs: jax.Array, ref: PyTree) -> PyTree:
    """Return ``ref + sum_i a_i (y_i - ref)``.

    Args:
      x: A stacked tree or a :class:`NodeView` (rows y).
      coeffs: (n,) coefficients a (need not sum to 1).
      ref: The reference tree; for a view it must be the view's centre.

    Returns:
      One tree (no node axis).
    """
    if not is_view(x):
        return tree.combine(x, coeffs, ref)
    b = coeffs if x.mixing is None else x.mixing.T @ coeffs
    if x.centre is None:
        return tree.weighted_sum(x.base, b)
    return tree.combine(x.base, b, x.centre)


def leaf_inputs(x: PyTree | NodeView) -> tuple[list, list, jax.Array | None, bool]:
    """Return what per-leaf kernels read of a stack or a view.

    Args:
      x: A stacked tree or a :class:`NodeView`.

    Returns:
      ``(base leaves, centre leaves or Nones, mixing or None, diagonal)``.
    """
    if not is_view(x):
        leaves = jax.tree_util.tree_leaves(x)
        return leaves, [None] * len(leaves), None, True
    leaves = jax.tree_util.tree_leaves(x.base)
    centres = [None] * len(leaves) if x.centre is None else jax.tree_util.tree_leaves(x.centre)
    return leaves, centres, x.mixing, x.diagonal


def materialize(x: PyTree | NodeView | DroppedRows) -> PyTree:
    """Write out the rows of y as an ordinary stacked tree (one copy of the stack).

    Args:
      x: A stacked tree (returned as it is), a :class:`NodeView` or :class:`DroppedRows`.

    Returns:
      The stacked tree of the rows; invalid rows are NaN.
    """
    if is_dropped(x):
        from kernels.dropout import dropped_rows

        leaves = jax.tree_util.tree_leaves(x.base)
        centres = jax.tree_util.tree_leaves(x.centre)
        out = [
            dropped_rows(v, c, k, x.density, x.factor, x.valid)
            for v, c, k in zip(leaves, centres, x.keys, strict=True)
        ]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x.base), out)
    if not is_view(x) or (x.mixing is None and x.valid is None):
        return base_of(x)
    from kernels import rows as row_kernels

    leaves, centres, mixing, diagonal = leaf_inputs(x)
    n = leaves[0].shape[0]
    mixing = jnp.eye(n, dtype=jnp.float32) if mixing is None else mixing
    out = [
        row_kernels.materialize_view(leaf, mixing, c, x.valid, diagonal=diagonal)
        for leaf, c in zip(leaves, centres, strict=True)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x.base), out)
