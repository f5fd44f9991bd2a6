"""RegMean: the closed-form merge of linear layers from the nodes' input Gram matrices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.base import Aggregator
from consensus.merging._common import (
    RuleState,
    info,
    init_rule_state,
    leaves_of,
    optimistic,
    require_base,
    require_valid_count,
    unflatten_like,
)
from consensus.specs import RULES, at_least
from kernels import rows as row_kernels
from kernels.compile_options import kernel_jit

PyTree = Any
HIGHEST = jax.lax.Precision.HIGHEST


@kernel_jit
def _regmean_leaf(x, base, grams, valid, off_diagonal_scale, ridge):
    """Return base + (sum_i G~_i + r I)^{-1} sum_i G~_i (W_i - base) over the valid nodes, float32."""
    d_in = grams.shape[-1]
    eye = jnp.eye(d_in, dtype=jnp.float32)
    g = grams.astype(jnp.float32)
    g = off_diagonal_scale * g + (1.0 - off_diagonal_scale) * g * eye  # G~ = a G + (1 - a) diag(G)
    keep = valid[:, None, None]
    g = jnp.where(keep, g, 0.0)
    delta = jnp.where(keep, x.astype(jnp.float32) - base.astype(jnp.float32)[None], 0.0)
    total = jnp.sum(g, axis=0)
    rhs = jnp.einsum("nij,njk->ik", g, delta, precision=HIGHEST)
    scale = jnp.trace(total) / d_in
    lhs = total + ridge * jnp.where(scale > 0, scale, 1.0) * eye
    merged = base.astype(jnp.float32) + jnp.linalg.solve(lhs, rhs)
    return merged.astype(x.dtype)


@RULES.declare(
    kind="merge",
    precondition=at_least(1),
    sensitivity="not bounded (data-dependent layer weights)",
    needs=("params", "grams"),
)
def regmean(off_diagonal_scale: float = 1.0, ridge: float = 1e-6) -> Aggregator:
    r"""RegMean (Jin et al. 2023): the closed-form least-squares merge of linear layers.

    For a linear layer ``y = x W`` (a flax Dense kernel W of shape (d_in, d_out))
    the merge minimizing ``sum_i ||X_i W - X_i W_i||^2`` over the nodes' inputs
    X_i is the closed form

    .. math:: W = \Big(\sum_{i \in V} \tilde G_i\Big)^{-1} \sum_{i \in V} \tilde G_i W_i,\qquad
              \tilde G_i = a\, G_i + (1 - a)\operatorname{diag}(G_i),\quad G_i = X_i^\top X_i

    with a = ``off_diagonal_scale`` (the paper's alpha; 1 is the exact least
    squares solution, the paper uses a < 1 to regularize towards the plain
    average) and a ridge ``ridge * tr(sum G~) / d_in * I`` so a rank-deficient
    sum (fewer examples than inputs) stays solvable. Computed on task vectors
    around ``params`` (the same formula). Every leaf without a Gram matrix
    (biases, norms, embeddings) is the plain mean of the valid nodes.

    The nodes submit their Gram matrices as ``update(stacked, state, base,
    grams={leaf path: (n, d_in, d_in) array})``, keyed by the leaf's path as
    :func:`consensus.tree.leaf_paths` writes it (see
    :func:`strategies.statistics.node_statistics`). What they reveal: G_i is
    the uncentred second moment of node i's inputs to the layer (for the first
    layer, of its raw data): every feature's mean square and every pair's
    correlation over its examples, enough to reconstruct principal directions
    of the data and, with few examples (n_i <= d_in), the inputs themselves up
    to a rotation. It is not DP; share it only where the data may be.

    Not robust: a node's Gram matrix weighs its layer arbitrarily. Permutation
    invariant. DP sensitivity: not bounded. Precondition: at least 1 valid node.

    Args:
      off_diagonal_scale: a, the scale of the Gram matrices' off-diagonal part, in [0, 1].
      ridge: The relative ridge r (>= 0): ``ridge * tr(sum G~) / d_in`` is added to the diagonal.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` (the base) and
      ``grams=``.

    Raises:
      ValueError: If ``off_diagonal_scale`` is outside [0, 1] or ``ridge`` < 0; from
        ``update``, when the base or ``grams`` is missing, a Gram matrix names an unknown leaf
        or has the wrong shape.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Jin, Ren, Preotiuc-Pietro and Cheng 2023, ICLR, "Dataless Knowledge Fusion by Merging
      Weights of Language Models".
    """
    a = float(off_diagonal_scale)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"regmean: off_diagonal_scale must be in [0, 1], got {off_diagonal_scale!r}")
    if not float(ridge) >= 0:
        raise ValueError(f"regmean: ridge must be >= 0, got {ridge!r}")

    def update(stacked, state, params=None, *, mask=None, grams=None, assume_finite=False, **extra):
        del state, extra
        stacked, n = require_base("regmean", stacked, params)
        if not isinstance(grams, Mapping) or not grams:
            raise ValueError(
                "regmean: needs the nodes' input Gram matrices: update(stacked, state, base, "
                "grams={leaf path: (n, d_in, d_in)})"
            )
        paths = tree.leaf_paths(params)
        unknown = sorted(set(grams) - set(paths))
        if unknown:
            raise ValueError(f"regmean: grams for unknown leaves {unknown}; leaf paths: {paths}")
        for path, p in zip(paths, jax.tree_util.tree_leaves(params), strict=True):
            if path in grams:
                g = grams[path]
                if jnp.ndim(p) != 2 or jnp.shape(g) != (n, jnp.shape(p)[0], jnp.shape(p)[0]):
                    raise ValueError(
                        f"regmean: leaf {path} of shape {jnp.shape(p)} needs a 2-D kernel (d_in, d_out) and "
                        f"grams of shape (n, d_in, d_in) with n={n}; got {jnp.shape(g)}"
                    )

        grams_ok = jnp.ones((n,), bool)
        if not assume_finite:
            for g in grams.values():
                grams_ok = grams_ok & jnp.all(jnp.isfinite(jnp.reshape(g, (n, -1))), axis=1)

        def compute(valid):
            valid = valid & grams_ok
            m = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
            coeffs = jnp.where(valid, 1.0 / m, 0.0)
            outs = []
            for path, x, b in zip(paths, *leaves_of(stacked, params), strict=True):
                if path in grams:
                    outs.append(_regmean_leaf(x, b, grams[path], valid, jnp.float32(a), jnp.float32(ridge)))
                else:
                    outs.append(row_kernels.weighted_sum(x, coeffs, b, 1.0 - jnp.sum(coeffs)).astype(x.dtype))
            return unflatten_like(params, outs)

        merged, valid = optimistic(stacked, mask, n, assume_finite, compute)
        valid = valid & grams_ok
        require_valid_count("regmean", at_least(1), valid, n)
        return merged, RuleState(info(valid, jnp.ones((n,), jnp.float32), False))

    return Aggregator(init_rule_state, update, "regmean")
