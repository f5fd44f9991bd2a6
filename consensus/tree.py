"""Stacked trees: n parameter trees with a leading node axis on every leaf.

Node-side code sees single trees; the coordinator sees stacked trees. This
module builds and checks them, and computes the two things every vector-wise
rule needs without ever flattening the stack into one copy:

* Gram statistics ``G = sum over leaves of D D^T`` on deltas ``D = X - ref``
  (leaf by leaf, streamed, float32 on device, summed over leaves in float64);
* one weighted-sum pass ``sum_i w_i x_i`` that turns a weight vector into a tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import gram as gram_kernels
from kernels import rows as row_kernels

PyTree = Any


class TreeMismatchError(ValueError):
    """Trees that should share one structure, shape and dtype do not."""


class NonFiniteError(ValueError):
    """A tree holds NaN or Inf where finite values are required."""


def leaf_paths(tree: PyTree) -> list[str]:
    """Return readable paths of the leaves of ``tree``, in flattening order.

    Args:
      tree: Any pytree.

    Returns:
      One ``jax.tree_util.keystr`` path per leaf (``"<root>"`` for a bare leaf).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(path) or "<root>" for path, _ in flat]


def _describe_structure_difference(ref: PyTree, other: PyTree) -> str:
    a, b = set(leaf_paths(ref)), set(leaf_paths(other))
    missing, extra = sorted(a - b), sorted(b - a)
    parts = []
    if missing:
        parts.append(f"missing leaves {missing[:5]}")
    if extra:
        parts.append(f"unexpected leaves {extra[:5]}")
    return "; ".join(parts) or "same leaf paths but a different container type"


def check_same_structure(trees: Sequence[PyTree], reference: PyTree | None = None) -> None:
    """Raise TreeMismatchError naming the node and leaf unless all trees match.

    Every tree must have the structure, leaf shapes and leaf dtypes of
    ``reference`` (default: the first tree).

    Args:
      trees: The trees to check.
      reference: The tree they must match, or None for the first one.

    Raises:
      ValueError: If ``trees`` is empty.
      TreeMismatchError: At the first node whose structure, shape or dtype differs.
    """
    if len(trees) == 0:
        raise ValueError("need at least one tree")
    ref = trees[0] if reference is None else reference
    ref_leaves, ref_def = jax.tree_util.tree_flatten(ref)
    paths = leaf_paths(ref)
    for i, tree in enumerate(trees):
        leaves, tdef = jax.tree_util.tree_flatten(tree)
        if tdef != ref_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub declares no __ne__
            diff = _describe_structure_difference(ref, tree)
            raise TreeMismatchError(f"node {i}: tree structure differs from the reference: {diff}")
        for path, a, b in zip(paths, ref_leaves, leaves, strict=True):
            if np.shape(a) != np.shape(b):
                raise TreeMismatchError(
                    f"node {i}, leaf {path}: shape {np.shape(b)} differs from the reference {np.shape(a)}"
                )
            if jnp.result_type(a) != jnp.result_type(b):
                raise TreeMismatchError(
                    f"node {i}, leaf {path}: dtype {jnp.result_type(b)} differs from "
                    f"the reference {jnp.result_type(a)}"
                )


def stack(trees: Sequence[PyTree], *, reference: PyTree | None = None) -> PyTree:
    """Stack n trees into one tree whose leaves have a leading node axis of size n.

    Non-finite values are allowed here: the aggregators exclude such nodes and report them;
    use :func:`check_finite` to refuse them outright.

    Args:
      trees: The n node trees, all of one structure, shape and dtype.
      reference: The tree they must match, or None for the first one.

    Returns:
      The stacked tree.

    Raises:
      ValueError: If ``trees`` is empty.
      TreeMismatchError: Naming the node and leaf, when the trees differ in structure, shape
        or dtype.

    Example:
      >>> stacked = stack([{"w": jnp.zeros(3)}, {"w": jnp.ones(3)}])
      >>> stacked["w"].shape
      (2, 3)
    """
    trees = list(trees)
    check_same_structure(trees, reference)
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *trees)


def _signature(tree: PyTree) -> tuple[Any, ...]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, *((np.shape(x), jnp.result_type(x)) for x in leaves))


def refuse_unstacked(stacked: PyTree) -> None:
    """Raise TreeMismatchError when ``stacked`` is a list or tuple of like trees, not one stacked tree.

    The shapes alone cannot tell n node trees from a stacked tree whose top level is a
    sequence of like parts, so the refusal keeps to what node trees look like: a list of like
    trees, or a tuple of like containers (dicts, States, ...). A tuple of like arrays stays a
    stacked tree, as ``(w, b)`` of one shape is; wrap a stacked list of like layers in a dict.

    Args:
      stacked: What a caller passed as a stacked tree.

    Raises:
      TreeMismatchError: If it looks like n unstacked node trees.
    """
    if type(stacked) not in (list, tuple) or len(stacked) < 2:
        return
    if type(stacked) is tuple and all(jax.tree_util.treedef_is_leaf(jax.tree.structure(t)) for t in stacked):
        return
    first = _signature(stacked[0])
    if all(_signature(t) == first for t in stacked[1:]):
        raise TreeMismatchError(
            f"got a {type(stacked).__name__} of {len(stacked)} trees, not one stacked tree; "
            "stack them first with consensus.stack(trees) (a leading node axis on every leaf)"
        )


def num_nodes(stacked: PyTree) -> int:
    """Return the size n of the leading node axis (checked to agree across leaves).

    A plain list or tuple of trees of one structure, shape and dtype is refused: it is n
    unstacked node trees (stack them with :func:`stack`), whose leaves' first dimension
    would otherwise be read as the node axis.

    Args:
      stacked: A stacked tree.

    Returns:
      n.

    Raises:
      ValueError: If the tree has no leaves.
      TreeMismatchError: If it is a sequence of unstacked trees, or its leaves disagree on n
        (or one is a scalar).
    """
    refuse_unstacked(stacked)
    leaves = jax.tree_util.tree_leaves(stacked)
    if not leaves:
        raise ValueError("stacked tree has no leaves")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        paths = leaf_paths(stacked)
        detail = {p: (np.shape(x)[0] if np.ndim(x) else "scalar") for p, x in zip(paths, leaves, strict=True)}
        raise TreeMismatchError(
            f"stacked tree: leaves disagree on the node axis size: {detail}; every leaf needs a leading "
            "node axis of the same size n (consensus.stack(trees) builds one from n trees)"
        )
    n = sizes.pop()
    assert n is not None  # ruled out above
    return n


def unstack(stacked: PyTree) -> list[PyTree]:
    """Split a stacked tree into its n node trees (the inverse of :func:`stack`).

    Args:
      stacked: A stacked tree.

    Returns:
      A list of n trees.
    """
    n = num_nodes(stacked)
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)]


def check_stacked_against(stacked: PyTree, params: PyTree) -> None:
    """Raise TreeMismatchError unless ``stacked`` is ``params`` with a node axis added.

    Args:
      stacked: A stacked tree.
      params: The global tree (no node axis).

    Raises:
      TreeMismatchError: If the structures differ or a leaf's shape or dtype is not the
        param's with a leading axis.
    """
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    s_leaves, s_def = jax.tree_util.tree_flatten(stacked)
    if p_def != s_def:  # type: ignore[operator]  # as in check_trees
        raise TreeMismatchError(
            "stacked tree and params differ in structure: " + _describe_structure_difference(params, stacked)
        )
    n = num_nodes(stacked)
    for path, p, s in zip(leaf_paths(params), p_leaves, s_leaves, strict=True):
        if tuple(np.shape(s)) != (n, *np.shape(p)):
            raise TreeMismatchError(
                f"leaf {path}: stacked shape {np.shape(s)} is not (n={n},) + params shape {np.shape(p)}"
            )
        if jnp.result_type(p) != jnp.result_type(s):
            raise TreeMismatchError(
                f"leaf {path}: stacked dtype {jnp.result_type(s)} != params dtype {jnp.result_type(p)}"
            )


@jax.jit
def finite_mask(stacked: PyTree) -> jax.Array:
    """Tell which nodes hold only finite values (one compiled call for the whole tree).

    Args:
      stacked: A stacked tree.

    Returns:
      (n,) bool, True for nodes whose every leaf is finite.
    """
    masks = [row_kernels.finite_rows(x) for x in jax.tree_util.tree_leaves(stacked)]
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


@jax.jit
def is_finite(tree_: PyTree) -> jax.Array:
    """Tell whether every entry of every leaf of a tree is finite; one compiled call.

    As ``isfinite(sum(x * 0))``: x * 0 is NaN exactly where x is NaN or +-Inf, and a float
    sum vectorizes on XLA:CPU where a boolean ``all`` does not.

    Args:
      tree_: Any tree of arrays.

    Returns:
      A scalar bool array.
    """
    sums = [jnp.sum(x.astype(jnp.float32) * 0.0) for x in jax.tree_util.tree_leaves(tree_)]
    return jnp.isfinite(sum(sums[1:], sums[0]))


def nonfinite_report(stacked: PyTree) -> list[tuple[int, str]]:
    """List the (node, leaf path) pairs holding NaN or Inf. Eager (not for use under jit).

    Args:
      stacked: A stacked tree.

    Returns:
      ``[(node index, leaf path), ...]``, empty when everything is finite.
    """
    out: list[tuple[int, str]] = []
    for path, x in zip(leaf_paths(stacked), jax.tree_util.tree_leaves(stacked), strict=True):
        bad = np.flatnonzero(~np.asarray(row_kernels.finite_rows(x)))
        out.extend((int(i), path) for i in bad)
    return sorted(out)


def check_finite(stacked: PyTree) -> None:
    """Raise NonFiniteError naming every node and leaf that holds NaN or Inf.

    Args:
      stacked: A stacked tree.

    Raises:
      NonFiniteError: If some node leaf holds NaN or Inf.
    """
    bad = nonfinite_report(stacked)
    if bad:
        listing = ", ".join(f"node {i} leaf {p}" for i, p in bad[:10])
        raise NonFiniteError(f"non-finite values (NaN or Inf) in {len(bad)} node leaves: {listing}")


def gram(stacked: PyTree, ref: PyTree | None = None) -> jax.Array:
    """Compute the Gram matrix of the node deltas over the whole tree, (n, n) float32.

    ``G[i, j] = sum over leaves of <x_i - ref, x_j - ref>``. Each leaf is
    streamed once by :func:`kernels.gram.gram`; the stack is never flattened or
    concatenated. Pass the current global params as ``ref``: distances computed
    from G on raw parameters cancel catastrophically when nodes are close.

    Args:
      stacked: A stacked tree.
      ref: The centre (a tree like one node), or None for 0.

    Returns:
      (n, n) float32 Gram matrix.
    """
    leaves = jax.tree_util.tree_leaves(stacked)
    refs = [None] * len(leaves) if ref is None else jax.tree_util.tree_leaves(ref)
    total = None
    for x, r in zip(leaves, refs, strict=True):
        g = gram_kernels.gram(x, r)
        total = g if total is None else total + g
    assert total is not None, "a tree without leaves has no Gram matrix"
    return total


def gram_f64(stacked: PyTree, ref: PyTree | None = None) -> np.ndarray:
    """Compute :func:`gram`, summed over leaves in float64 on the host (eager only).

    Args:
      stacked: A stacked tree.
      ref: The centre (a tree like one node), or None for 0.

    Returns:
      (n, n) float64 numpy Gram matrix.
    """
    leaves = jax.tree_util.tree_leaves(stacked)
    refs = [None] * len(leaves) if ref is None else jax.tree_util.tree_leaves(ref)
    total: np.ndarray | float = 0.0
    for x, r in zip(leaves, refs, strict=True):
        total = total + np.asarray(gram_kernels.gram(x, r), dtype=np.float64)
    return np.asarray(total)


def sq_norms(stacked: PyTree, ref: PyTree | None = None) -> jax.Array:
    """Compute the squared L2 norms of the node deltas ``x_i - ref`` over the whole tree.

    Args:
      stacked: A stacked tree.
      ref: The centre (a tree like one node), or None for 0.

    Returns:
      (n,) float32 squared norms.
    """
    leaves = jax.tree_util.tree_leaves(stacked)
    refs = [None] * len(leaves) if ref is None else jax.tree_util.tree_leaves(ref)
    total = None
    for x, r in zip(leaves, refs, strict=True):
        s = row_kernels.row_sq_norms(x, r)
        total = s if total is None else total + s
    assert total is not None, "a tree without leaves has no norms"
    return total


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
    """Compute ``sum_i weights[i] * x_i`` leaf by leaf, one streaming pass, in the leaves' dtype.

    Nodes with weight exactly 0 contribute nothing, even if they hold NaN/Inf.

    Args:
      stacked: A stacked tree.
      weights: (n,) weights.

    Returns:
      One tree (no node axis).
    """
    return jax.tree.map(lambda x: row_kernels.weighted_sum(x, weights).astype(x.dtype), stacked)


def combine(
    stacked: PyTree, weights: jax.Array, ref: PyTree | None = None, total: float | jax.Array = 1.0
) -> PyTree:
    """Compute ``total * ref + sum_i w_i (x_i - ref)``, one pass over the stack.

    With the default ``total = 1`` this is ``ref + sum_i w_i (x_i - ref)``, which
    equals :func:`weighted_sum` when the weights sum to 1; with ``ref=None`` it
    is the plain weighted sum.

    Args:
      stacked: A stacked tree.
      weights: (n,) coefficients w.
      ref: The reference tree, or None.
      total: The factor on ``ref``.

    Returns:
      One tree (no node axis).
    """
    if ref is None:
        return weighted_sum(stacked, weights)
    # sum_i w_i x_i + (total - sum_i w_i) ref
    rest = total - jnp.sum(weights)

    def leaf(x, r):
        return row_kernels.weighted_sum(x, weights, r, rest).astype(x.dtype)

    return jax.tree.map(leaf, stacked, ref)


def broadcast(params: PyTree, n: int) -> PyTree:
    """Return a stacked tree with n copies of ``params``.

    Args:
      params: A tree (no node axis).
      n: The number of copies.

    Returns:
      The stacked tree.
    """
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *jnp.shape(p))), params)
