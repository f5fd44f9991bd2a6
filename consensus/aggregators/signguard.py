"""SignGuard: a norm filter and a sign-statistics cluster filter, then a clipped mean.

References:
  Xu, Huang, Xue and Li 2022, ICDCS, "SignGuard: Byzantine-robust Federated Learning
  through Collaborative Malicious Gradient Filtering".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    allowed,
    check_count,
    check_stacked,
    init_rule_state,
    require_key,
    static_count,
)
from consensus.aggregators._subsample import columns, sample_coordinates
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, at_least


def sign_features(cols: jax.Array) -> jax.Array:
    """Return the fractions of positive, zero and negative entries of each row.

    Args:
      cols: (n, d) values.

    Returns:
      (n, 3) float fractions.
    """
    return jnp.stack(
        [
            jnp.mean((cols > 0).astype(jnp.float32), 1),
            jnp.mean((cols == 0).astype(jnp.float32), 1),
            jnp.mean((cols < 0).astype(jnp.float32), 1),
        ],
        axis=1,
    )


def median_of_valid(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Return the median of ``values`` over the valid entries.

    Args:
      values: (n,) values.
      valid: (n,) bool, the entries that count.

    Returns:
      The scalar median (the mean of the two middle ones when their count is even).
    """
    s = jnp.sort(jnp.where(valid, values, jnp.inf))
    m = jnp.sum(valid.astype(jnp.int32))
    lo = jnp.maximum((m - 1) // 2, 0)
    hi = jnp.maximum(m // 2, 0)
    return 0.5 * (s[lo] + s[jnp.minimum(hi, values.shape[0] - 1)])


def _dists(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(a[:, None, :] - b[None, :, :]), axis=-1))


def largest_mean_shift_cluster(
    feats: jax.Array, valid: jax.Array, quantile: float = 0.5, steps: int = 20
) -> jax.Array:
    """Find the largest cluster of a flat-kernel mean shift over the valid rows of ``feats``.

    Bandwidth h as scikit-learn's ``estimate_bandwidth``: the mean over valid
    points of the distance to their k-th nearest valid point (itself counted
    first), k = max(1, floor(quantile * m)). Every valid point seeds a shift
    that moves ``steps`` times to the mean of the valid points within h;
    points whose modes lie within h / 2 of each other form a cluster; the
    largest wins (the lowest seed index on ties).

    Args:
      feats: (n, k) feature rows.
      valid: (n,) bool, the valid rows.
      quantile: The bandwidth quantile (k = max(1, floor(quantile * m))).
      steps: The number of shift steps.

    Returns:
      (n,) bool, the members of the largest cluster.
    """
    n = feats.shape[0]
    m = jnp.sum(valid.astype(jnp.int32))
    d = jnp.where(valid[None, :], _dists(feats, feats), jnp.inf)
    k = jnp.maximum(jnp.floor(quantile * m.astype(jnp.float32)).astype(jnp.int32), 1)
    kth = jnp.sort(d, axis=1)[:, jnp.clip(k - 1, 0, n - 1)]
    h = jnp.sum(jnp.where(valid, kth, 0.0)) / jnp.maximum(m, 1).astype(jnp.float32)

    def shift(_, seeds):
        near = (_dists(seeds, feats) <= h) & valid[None, :]
        cnt = jnp.sum(near.astype(jnp.float32), axis=1)
        moved = (near.astype(jnp.float32) @ feats) / jnp.maximum(cnt, 1.0)[:, None]
        return jnp.where((cnt > 0)[:, None], moved, seeds)

    modes = jax.lax.fori_loop(0, steps, shift, feats)
    close = (_dists(modes, modes) <= h / 2) & valid[:, None] & valid[None, :]
    size = jnp.where(valid, jnp.sum(close.astype(jnp.int32), axis=1), -1)
    return close[jnp.argmax(size)]


@RULES.declare(
    kind="vector",
    precondition=at_least(1),
    sensitivity="not bounded by a fixed C (deltas clipped to the median norm)",
    needs=("key",),
)
def signguard(
    lower: float = 0.1, upper: float = 3.0, subsample_dim: int = 10_000, bandwidth_quantile: float = 0.5
) -> Aggregator:
    """SignGuard (Xu et al. 2022): a norm filter and a sign-statistics cluster filter, then clipped mean.

    With deltas d_i = x_i - params (raw rows when params is None) and M the
    median norm of the valid nodes:

    1. norm filter S1 = {i : lower <= ||d_i|| / M <= upper} (all valid when M = 0);
    2. sign filter S2: on ``subsample_dim`` coordinates drawn from the key,
       each node's fractions of positive, zero and negative entries; S2 is the
       largest cluster of a flat-kernel mean shift over those features (see
       :func:`largest_mean_shift_cluster`; the paper uses scikit-learn's
       MeanShift, whose mode merging differs in detail);
    3. output params + mean over S = S1 and S2 (S1 alone if that is empty) of
       d_i min(1, M / ||d_i||).

    Takes no f (the filters are f-agnostic). Randomized: pass ``key=``.
    ``info.selected`` is S; ``info.weights`` the coefficients of the d_i.
    Precondition: m >= 1. Cost: one norm pass, a gather, one weighted pass.
    DP sensitivity: not bounded by a fixed C (M is the median norm).

    Args:
      lower: The norm filter's lower bound on ||d_i|| / M.
      upper: The norm filter's upper bound on ||d_i|| / M (greater than ``lower``).
      subsample_dim: The number of coordinates drawn for the sign features.
      bandwidth_quantile: The mean-shift bandwidth quantile, in (0, 1].

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``key=``.

    Raises:
      ValueError: If 0 <= lower < upper does not hold or ``bandwidth_quantile`` is outside
        (0, 1]; from ``update``, when no ``key`` is given.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Xu, Huang, Xue and Li 2022, ICDCS, "SignGuard: Byzantine-robust Federated Learning
      through Collaborative Malicious Gradient Filtering".
    """
    if not 0 <= lower < upper:
        raise ValueError(f"signguard: needs 0 <= lower < upper, got lower={lower}, upper={upper}")
    if not 0 < bandwidth_quantile <= 1:
        raise ValueError(f"signguard: bandwidth_quantile must be in (0, 1], got {bandwidth_quantile}")

    def update(stacked, state, params=None, *, mask=None, key=None, **extra):
        del state, extra
        key = require_key("signguard", key)
        n = check_stacked(stacked, params)
        sq = tree.sq_norms(stacked, params)
        valid = allowed(mask, n) & jnp.isfinite(sq)
        check_count("signguard", at_least(1), 0, static_count(valid))
        norms = jnp.sqrt(jnp.maximum(jnp.where(valid, sq, 0.0), 0.0))
        med = median_of_valid(norms, valid)
        ratio = norms / jnp.where(med > 0, med, 1.0)
        s1 = valid & jnp.where(med > 0, (ratio >= lower) & (ratio <= upper), True)
        total = sum(math.prod(x.shape[1:]) for x in jax.tree_util.tree_leaves(stacked))
        cols = columns(stacked, params, sample_coordinates(key, total, subsample_dim))
        feats = sign_features(jnp.where(valid[:, None], cols, 0.0))
        s2 = largest_mean_shift_cluster(feats, valid, bandwidth_quantile)
        both = s1 & s2
        chosen = jnp.where(jnp.any(both), both, s1)
        clip = jnp.where(norms > med, med / jnp.maximum(norms, 1e-30), 1.0)
        count = jnp.maximum(jnp.sum(chosen.astype(jnp.float32)), 1.0)
        a = jnp.where(chosen, clip, 0.0) / count
        merged = views.combine(stacked, a, params) if params is not None else views.weighted_sum(stacked, a)
        return merged, RuleState(AggregationInfo(valid, chosen, a, True))

    return Aggregator(init_rule_state, update, "signguard")
