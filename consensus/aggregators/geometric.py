"""Rules solved in Gram space: geometric median (Weiszfeld) and centered clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_stacked,
    gram_stats,
    init_rule_state,
    medoid,
    recentre_gram,
    static_count,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, at_least
from kernels import weiszfeld


@RULES.declare(kind="vector", precondition=at_least(1), reads_views=True)
def geometric_median(max_iter: int = 100, eps: float = 1e-8, tol: float = 1e-6) -> Aggregator:
    r"""Geometric median by smoothed Weiszfeld iterations in Gram space (RFA).

    .. math:: z = \arg\min_z \sum_{i \in V} \alpha_i \lVert x_i - z \rVert_2

    Pillutla, Kakade and Harchaoui 2022 ("Robust Aggregation for Federated
    Learning"): z = sum_i w_i x_i with w_i ∝ alpha_i / max(||x_i - z||, eps).
    Every iteration costs O(n^2) on the Gram matrix, not a pass over the
    parameters: the whole rule is one Gram pass plus one weighted-sum pass.
    Node weights alpha default to uniform; give them per call as
    ``update(..., weights=alpha)``. Breakdown point 1/2: tolerates f < m/2.
    Precondition: m >= 1. ``info.weights`` are the final Weiszfeld weights.

    Args:
      max_iter: The largest number of Weiszfeld iterations.
      eps: The smoothing floor on distances (avoids division by zero at a node).
      tol: Convergence tolerance on the change of the iterate.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Pillutla, Kakade and Harchaoui 2022, IEEE Transactions on Signal Processing,
      "Robust Aggregation for Federated Learning".
    """

    def update(stacked, state, params=None, *, mask=None, weights=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        stats = gram_stats(stacked, params, mask)
        check_count("geometric_median", at_least(1), 0, static_count(stats.valid))
        alpha = None if weights is None else jnp.asarray(weights, jnp.float32).reshape(n)
        w, _ = weiszfeld.geometric_median_weights(
            stats.gram, stats.valid, alpha, max_iter=max_iter, eps=eps, tol=tol
        )
        merged = views.weighted_sum(stacked, w)
        return merged, RuleState(AggregationInfo(stats.valid, stats.valid, w, True))

    return Aggregator(init_rule_state, update, "geometric_median")


@RULES.declare(kind="vector", precondition=at_least(1), defaults={"clip_radius": 10.0}, reads_views=True)
def centered_clipping(clip_radius: float, iterations: int = 1) -> Aggregator:
    r"""Centered clipping (Karimireddy, He and Jaggi 2021): clip the nodes around the last consensus.

    .. math::
        v_{l+1} = v_l + \frac{1}{m} \sum_{i \in V} (x_i - v_l)
                  \min(1, \tau / \lVert x_i - v_l \rVert)

    for ``iterations`` steps from v_0 = ``params`` (the previous consensus, so
    the previous aggregate *update* is taken as zero). With params=None, v_0 is
    the medoid: the valid node with the smallest sum of distances to the other
    valid nodes (lowest index on ties), a robust start that costs no pass over
    the parameters. Solved in Gram space: one Gram pass and one weighted pass.
    ``info.weights`` are the coefficients a with v = v_0 + sum_i a_i (x_i - v_0);
    the rest, 1 - sum(a), stays on v_0. Without params they are the weights w of
    v = sum_i w_i x_i (v_0's share folded into the medoid's weight; they sum to 1).
    Precondition: m >= 1, tau > 0.

    Args:
      clip_radius: tau > 0, the clipping radius around the current iterate.
      iterations: The number of clipping steps (a positive int).

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ValueError: If ``clip_radius`` is not > 0 or ``iterations`` not a positive int.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Karimireddy, He and Jaggi 2021, ICML, "Learning from History for Byzantine Robust
      Optimization".
    """
    if not clip_radius > 0:
        raise ValueError(f"centered_clipping: clip_radius must be > 0, got {clip_radius}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"centered_clipping: iterations must be a positive int, got {iterations!r}")

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        check_stacked(stacked, params)
        stats = gram_stats(stacked, params, mask)
        check_count("centered_clipping", at_least(1), 0, static_count(stats.valid))
        if stats.centre is None:
            # No params (and no view centre): start from the medoid node r, a robust point of the
            # data found in Gram space. With v_0 = x_r the output is a weighted sum of the rows,
            # sum_i w_i x_i with w = a + (1 - sum(a)) e_r: one pass, no centre vector to read.
            r = medoid(stats.sq_dists, stats.valid)
            g = jnp.where(stats.valid[:, None] & stats.valid[None, :], recentre_gram(stats.gram, r), 0.0)
            tau = float(clip_radius)
            a = weiszfeld.centered_clipping_coefficients(g, stats.valid, tau, iterations=iterations)
            w = a + (1.0 - jnp.sum(a)) * jax.nn.one_hot(r, a.shape[0], dtype=a.dtype)
            merged = views.weighted_sum(stacked, w)
            return merged, RuleState(AggregationInfo(stats.valid, stats.valid, w, True))
        a = weiszfeld.centered_clipping_coefficients(
            stats.gram, stats.valid, float(clip_radius), iterations=iterations
        )
        merged = views.combine(stacked, a, stats.centre)
        return merged, RuleState(AggregationInfo(stats.valid, stats.valid, a, True))

    return Aggregator(init_rule_state, update, "centered_clipping")
