"""Plain averaging: the FedAvg baseline, uniform or weighted."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    all_finite,
    allowed,
    check_stacked,
    init_rule_state,
    non_finite_note,
    static_count,
    under_outer_jit,
    uniform_over,
    unless_non_finite,
    valid_nodes,
)
from consensus.base import AggregationInfo, Aggregator, ByzantineToleranceError
from consensus.specs import RULES, Precondition, at_least

PyTree = Any


def _optimistic_sum(stacked, mask, n: int, weights_for):
    """One pass in the common case: weigh every allowed node, then check the result.

    NaN and +-Inf always survive a weighted sum with non-zero weights (Inf - Inf
    is NaN), so a finite result proves every allowed node was finite and the
    separate finiteness pass can be skipped. Only when the result is not finite
    does the rule pay for the finiteness pass and a second sum: eagerly by
    returning None, under an outer jit by :func:`unless_non_finite`, whose
    fallback (the finiteness pass and the sum over the finite nodes) only runs
    then.
    Returns (merged, valid, weights), or None when the fast path does not apply.
    """
    if views.is_view(stacked) and stacked.valid is not None:
        return None
    valid = allowed(mask, n)
    w = weights_for(valid)
    merged = views.weighted_sum(stacked, w)
    if not under_outer_jit(stacked, mask):
        return (merged, valid, w) if bool(all_finite(merged)) else None

    def over_finite_nodes():
        ok = valid_nodes(stacked, mask)
        w_ok = weights_for(ok)
        return views.weighted_sum(stacked, w_ok), ok, w_ok

    return unless_non_finite((merged, valid, w), over_finite_nodes)


def _require_some(rule: str, precondition: Precondition, valid: jax.Array, n: int) -> None:
    """Raise when a concrete valid count fails the rule's declared precondition (no valid node at all)."""
    m = static_count(valid)
    needed = None if m is None else precondition(m, 0)
    if needed is not None:
        raise ByzantineToleranceError(
            f"{rule}: no valid node out of n={n}; needs {needed}.{non_finite_note(m)}"
        )


@RULES.declare(
    kind="coordinatewise",
    precondition=at_least(1),
    sensitivity="C / n (uniform mean)",
    elementwise=True,
    reads_views=True,
    # DP-FedAvg's C / n sensitivity holds for a uniform mean of clipped updates only.
    traits={"uniform_mean": True},
)
def mean() -> Aggregator:
    r"""Uniform mean of the valid nodes (FedAvg with equal weights).

    .. math:: \bar x = \frac{1}{m} \sum_{i \in V} x_i

    V is the set of valid nodes (allowed by ``mask`` and finite), m = ``|V|``.
    Not robust: a single Byzantine node moves the output arbitrarily far.
    Precondition: m >= 1. DP sensitivity: C / n (a uniform mean of updates clipped to C).
    ``update`` also takes ``assume_finite=True`` to skip the finiteness check.

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.weights`` is 1/m on every valid node.

    Raises:
      ByzantineToleranceError: From ``update``, when no node is valid.

    Example:
      >>> from consensus import stack
      >>> params = {"w": jnp.zeros(2)}
      >>> stacked = stack([{"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])}])
      >>> agg = mean(); state = agg.init(params)
      >>> merged, state = agg.update(stacked, state)
      >>> merged["w"]
      Array([2., 3.], dtype=float32)
    """

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        fast = None if assume_finite else _optimistic_sum(stacked, mask, n, uniform_over)
        if fast is not None and static_count(fast[1]) != 0:
            merged, valid, w = fast
            return merged, RuleState(AggregationInfo(valid, valid, w, True))
        valid = valid_nodes(stacked, mask, assume_finite)
        _require_some("mean", at_least(1), valid, n)
        w = uniform_over(valid)
        merged = views.weighted_sum(stacked, w)
        return merged, RuleState(AggregationInfo(valid, valid, w, True))

    return Aggregator(init_rule_state, update, "mean")


@RULES.declare(
    kind="coordinatewise",
    precondition=at_least(1),
    sensitivity="C * max_i w_i (fixed weights)",
    elementwise=True,
    needs=("weights",),  # at construction (its parameter) or as update(..., weights=...)
    reads_views=True,
)
def weighted_mean(weights: jax.Array | np.ndarray | None = None) -> Aggregator:
    r"""Weighted mean with non-negative node weights, renormalized over the valid nodes.

    .. math:: \bar x = \sum_{i \in V} \frac{\alpha_i}{\sum_{j \in V} \alpha_j} x_i

    The weights (for example local dataset sizes, McMahan et al. 2017) are given
    here or per call as ``update(..., weights=alpha)``; per-call weights win.
    Not robust. Precondition: some valid node has a positive weight.
    DP sensitivity: C * max_i w_i (fixed weights).

    Args:
      weights: (n,) non-negative node weights alpha, or None to require them per call.

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.weights`` are the renormalized weights.

    Raises:
      ValueError: From ``update``, when no weights are given (here or per call), their shape
        is not (n,), or one is negative.
      ByzantineToleranceError: From ``update``, when no valid node has a positive weight.

    References:
      McMahan, Moore, Ramage, Hampson and Agüera y Arcas 2017, AISTATS,
      "Communication-Efficient Learning of Deep Networks from Decentralized Data".
    """
    fixed = None if weights is None else jnp.asarray(weights, jnp.float32)

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, weights=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        alpha = fixed if weights is None else jnp.asarray(weights, jnp.float32)
        if alpha is None:
            raise ValueError("weighted_mean: node weights are required (here or as update(..., weights=...))")
        if alpha.shape != (n,):
            raise ValueError(f"weighted_mean: weights must have shape ({n},), got {alpha.shape}")
        if static_count(alpha < 0) not in (None, 0):
            raise ValueError("weighted_mean: weights must be non-negative")

        def normalized(ok):
            a = jnp.where(ok, alpha, 0.0)
            return a / jnp.sum(a)

        # The one-pass check only sees nodes with a positive weight: use it when all have one.
        if not assume_finite and static_count(alpha <= 0) == 0:
            fast = _optimistic_sum(stacked, mask, n, normalized)
            if fast is not None and static_count(fast[1]) != 0:
                merged, valid, w = fast
                return merged, RuleState(AggregationInfo(valid, valid & (w > 0), w, True))
        valid = valid_nodes(stacked, mask, assume_finite)
        a = jnp.where(valid, alpha, 0.0)
        if static_count(a > 0) == 0:
            raise ByzantineToleranceError(
                f"weighted_mean: no valid node with a positive weight out of n={n}."
            )
        w = a / jnp.sum(a)
        merged = views.weighted_sum(stacked, w)
        return merged, RuleState(AggregationInfo(valid, valid & (w > 0), w, True))

    return Aggregator(init_rule_state, update, "weighted_mean")
