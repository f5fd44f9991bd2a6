"""Task arithmetic: add the (weighted, scaled) sum of the task vectors to the base."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators import view as views
from consensus.base import AggregationInfo, Aggregator
from consensus.merging._common import (
    RuleState,
    check_flag,
    check_scale,
    fixed_weights,
    info,
    init_rule_state,
    node_weights,
    optimistic,
    require_base,
    require_valid_count,
)
from consensus.specs import RULES, at_least
from kernels import rows as row_kernels
from kernels.compile_options import kernel_jit
from kernels.dropout import dropped_delta_sum
from kernels.rows import tree_sum

PyTree = Any


@kernel_jit
def delta_sum(x: jax.Array, base: jax.Array, coeffs: jax.Array) -> jax.Array:
    """Compute ``base + sum_i c_i (x_i - base)`` in one fused pass; rows with c_i = 0 never enter.

    Written on the deltas rather than as ``sum_i c_i x_i + (1 - sum c) base``:
    a node equal to the base contributes exactly 0, and there is no
    cancellation between a large ``sum c`` and the base. NaN-safe: a row with c_i = 0 is
    never read into the sum.

    Args:
      x: (n, ...) node rows of one leaf.
      base: The base leaf (no node axis).
      coeffs: (n,) coefficients c.

    Returns:
      The merged leaf, shaped like ``base``.
    """
    b = base.astype(jnp.float32)
    terms = [
        jnp.where(coeffs[i] != 0, coeffs[i] * (x[i].astype(jnp.float32) - b), 0.0) for i in range(x.shape[0])
    ]
    return (b + tree_sum(terms)).astype(x.dtype)


@RULES.declare(
    kind="merge",
    precondition=at_least(1),
    sensitivity="scale * max_i w_i * C (a weighted sum of clipped deltas)",
    needs=("params",),
    elementwise=True,
    reads_dropped=True,
)
def task_arithmetic(scale: float = 1.0, weights: Any = None, normalize: bool = False) -> Aggregator:
    r"""Task arithmetic (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023).

    .. math:: \theta = \theta_0 + \lambda \sum_{i \in V} w_i (x_i - \theta_0)

    with ``params`` = theta_0 the common base, lambda = ``scale`` and node
    weights w (default 1). A *sum* of task vectors, not a mean, as in the paper
    and mergekit's ``task_arithmetic`` with ``normalize: false``; the mean of the
    nodes is ``scale = 1/n`` (mergekit's default ``normalize: true`` divides by
    the sum of the weights, i.e. the weighted mean of the nodes, then scales
    nothing). The paper tunes lambda on held-out data (0.3-0.4 for 8 tasks).
    V are the valid nodes (allowed by ``mask`` and finite); w are given here or
    per call ``update(..., weights=w)``. ``normalize=True`` divides the weights by
    their sum over the valid nodes (a sum below 1e-8 in magnitude divides by 1), as
    mergekit's ``normalize: true``. One pass over the stack, also after
    ``dare`` inside ``process`` (the drop is computed where each entry is read).

    Not robust: one node moves the output arbitrarily far. Compose with the
    votes, e.g. ``process(task_arithmetic(0.3), pre=[nnm(f)])``.
    DP sensitivity: ``scale * max_i w_i * C`` for node deltas clipped to C
    (adding or removing one node adds or removes one term of the sum).
    Precondition: at least 1 valid node.

    Args:
      scale: lambda, the factor on the sum of the task vectors (finite).
      weights: (n,) non-negative node weights w, or None for 1 (per-call weights win).
      normalize: Divide the weights by their sum over the valid nodes (mergekit's
        ``normalize: true``).

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` (the base).

    Raises:
      ValueError: If ``scale`` is not finite, ``normalize`` not a bool, or the weights are
        not a finite non-negative (n,) vector; from ``update``, when the base is missing or
        does not match the stack.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Ilharco, Ribeiro, Wortsman, Gururangan, Schmidt, Hajishirzi and Farhadi 2023, ICLR,
      "Editing Models with Task Arithmetic".
    """
    lam = check_scale("task_arithmetic", scale)
    fixed = fixed_weights("task_arithmetic", weights)
    normalize = check_flag("task_arithmetic", "normalize", normalize)

    def update(stacked, state, params=None, *, mask=None, weights=None, assume_finite=False, **extra):
        del state, extra
        # After dare(...) inside process: the drop is fused into the sum (one read, no stack written).
        dropped = stacked if views.is_dropped(stacked) else None
        if dropped is not None:
            stacked = dropped.base
            mask = dropped.valid if mask is None else jnp.asarray(mask, bool) & dropped.valid
        stacked, n = require_base("task_arithmetic", stacked, params)
        w = node_weights("task_arithmetic", fixed, weights, n)

        def compute(valid):
            coeffs = jnp.where(valid, lam * w, 0.0)
            if normalize:
                total = jnp.sum(jnp.where(valid, w, 0.0))
                coeffs = coeffs / jnp.where(jnp.abs(total) < 1e-8, 1.0, total)
            if dropped is None:
                return jax.tree.map(lambda x, b: delta_sum(x, b, coeffs), stacked, params)
            xs, bases = jax.tree_util.tree_leaves(stacked), jax.tree_util.tree_leaves(params)
            leaves = [
                dropped_delta_sum(x, b, coeffs, k, dropped.density, dropped.factor)
                for x, b, k in zip(xs, bases, dropped.keys, strict=True)
            ]
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)

        merged, valid = optimistic(stacked, mask, n, assume_finite, compute)
        require_valid_count("task_arithmetic", at_least(1), valid, n)
        return merged, RuleState(info(valid, w, False))

    return Aggregator(init_rule_state, update, "task_arithmetic")


@kernel_jit
def _linear_leaf(x: jax.Array, coeffs: jax.Array) -> jax.Array:
    return row_kernels.weighted_sum(x, coeffs).astype(x.dtype)


@RULES.declare(
    kind="merge",
    precondition=at_least(1),
    sensitivity="max_i w_i / sum_j w_j * C with normalize (a weighted mean), else max_i w_i * C",
    elementwise=True,
)
def linear(weights: Any = None, normalize: bool = True) -> Aggregator:
    r"""Linear merge, mergekit's ``linear``: a weighted sum of the models, divided by the sum of the weights.

    .. math:: \theta = \frac{\sum_{i \in V} w_i x_i}{\sum_{i \in V} w_i}
              \quad (\text{normalize}), \qquad \theta = \sum_{i \in V} w_i x_i \quad (\text{not})

    with node weights w (default 1: the plain mean) given here or per call
    ``update(..., weights=w)``, and V the valid nodes (allowed by ``mask`` and
    finite; an invalid node's weight leaves the sum and the divisor). mergekit's
    default is ``normalize: true``; there the divisor is the sum of all weights,
    which is the same when every node is valid. No base model is needed.
    One pass over the stack (element-wise: streamed in column chunks by the merge
    command). Not robust: one node moves the output arbitrarily far.
    Precondition: at least 1 valid node (with a positive weight when normalizing).

    Args:
      weights: (n,) non-negative node weights w, or None for 1 (per-call weights win).
      normalize: Divide by the sum of the valid nodes' weights (mergekit's default).

    Returns:
      An :class:`~consensus.base.Aggregator`; ``params`` is optional (checked against the
      stack when given).

    Raises:
      ValueError: If ``normalize`` is not a bool or the weights are not a finite
        non-negative (n,) vector.
      ByzantineToleranceError: From ``update``, when no node is valid.
    """
    fixed = fixed_weights("linear", weights)
    normalize = check_flag("linear", "normalize", normalize)

    def update(stacked, state, params=None, *, mask=None, weights=None, assume_finite=False, **extra):
        del state, extra
        stacked = views.materialize(stacked) if views.is_view(stacked) else stacked
        n = tree.num_nodes(stacked)
        if params is not None:
            tree.check_stacked_against(stacked, params)
        w = node_weights("linear", fixed, weights, n)

        def coefficients(valid):
            coeffs = jnp.where(valid, w, 0.0)
            if normalize:
                total = jnp.sum(coeffs)
                coeffs = coeffs / jnp.where(total == 0, 1.0, total)
            return coeffs

        def compute(valid):
            coeffs = coefficients(valid)
            return jax.tree.map(lambda x: _linear_leaf(x, coeffs), stacked)

        merged, valid = optimistic(stacked, mask, n, assume_finite, compute)
        require_valid_count("linear", at_least(1), valid, n)
        return merged, RuleState(AggregationInfo(valid, valid, coefficients(valid), True))

    return Aggregator(init_rule_state, update, "linear")
