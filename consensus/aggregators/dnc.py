"""Divide-and-conquer (DnC): drop the nodes that project most on the top singular direction.

References:
  Shejwalkar and Houmansadr 2021, NDSS, "Manipulating the Byzantine: Optimizing Model
  Poisoning Attacks and Defenses for Federated Learning".
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
    check_f,
    check_stacked,
    init_rule_state,
    nan_if,
    require_key,
    static_count,
    too_few,
    top_eigenpair,
    uniform_over,
)
from consensus.aggregators._subsample import columns, sample_coordinates
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, honest_majority
from kernels.gram import HIGHEST


def dnc_outliers(cols: jax.Array, valid: jax.Array, num_removed: int) -> jax.Array:
    """Flag the ``num_removed`` valid rows of ``cols`` with the largest DnC outlier scores.

    Scores s_i = <c_i - mu, v>^2 with mu the mean of the valid rows and v the
    top right singular vector of the centred valid rows; computed in n x n
    space as lambda u_i^2 from the top eigenpair (lambda, u) of their Gram matrix.

    Args:
      cols: (n, d) the subsampled coordinates of each node.
      valid: (n,) bool, the valid nodes.
      num_removed: How many nodes to flag.

    Returns:
      (n,) bool, the flagged nodes.
    """
    m = jnp.sum(valid.astype(jnp.float32))
    cols = jnp.where(valid[:, None], cols, 0.0)
    mu = jnp.sum(cols, axis=0) / jnp.maximum(m, 1.0)
    centred = jnp.where(valid[:, None], cols - mu[None], 0.0)
    lam, u = top_eigenpair(jnp.dot(centred, centred.T, precision=HIGHEST))
    scores = jnp.where(valid, lam * jnp.square(u), -jnp.inf)
    order = jnp.argsort(-scores, stable=True)
    rank = jnp.argsort(order, stable=True)
    return valid & (rank < num_removed)


@RULES.declare(kind="vector", takes_f=True, precondition=honest_majority, needs=("key",))
def dnc(
    num_byzantine: int, subsample_dim: int = 10_000, num_iters: int = 1, filter_frac: float = 1.0
) -> Aggregator:
    """Divide-and-conquer (Shejwalkar and Houmansadr 2021), the paper's Algorithm 2.

    For each of ``num_iters`` iterations: draw ``subsample_dim`` flat
    coordinates at random (uniform with replacement from the key, all of them
    when the model is smaller), centre the valid nodes' deltas on those
    coordinates on their mean, and score every node by its squared projection
    on the top singular direction; the floor(filter_frac * f) highest-scored
    nodes are flagged. The output is the mean of the valid nodes never
    flagged. Deltas are taken from ``params`` (or the raw rows when None),
    which does not change the rule (it centres on the mean) but keeps float32
    accurate. Randomized: pass ``key=`` (a jax.random key) to ``update``.
    ``info.selected`` is the good set, ``info.weights`` uniform over it.
    Precondition: m > 2f (ValueError otherwise; NaN under an outer jit).
    Cost: one norm pass (validity), a gather of the subsampled coordinates and
    one weighted-sum pass. DP sensitivity: as a selection followed by a
    uniform mean, 2C (output in the C-ball around the last consensus).

    Args:
      num_byzantine: f, the number of Byzantine nodes.
      subsample_dim: The number of coordinates drawn per iteration.
      num_iters: The number of iterations (fresh coordinates each).
      filter_frac: floor(filter_frac * f) nodes are flagged per iteration.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``key=``.

    Raises:
      ValueError: If an argument is out of range; from ``update``, when no ``key`` is given.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold.

    References:
      Shejwalkar and Houmansadr 2021, NDSS, "Manipulating the Byzantine: Optimizing Model
      Poisoning Attacks and Defenses for Federated Learning".
    """
    f = check_f("dnc", num_byzantine)
    if not isinstance(subsample_dim, int) or subsample_dim < 1:
        raise ValueError(f"dnc: subsample_dim must be a positive int, got {subsample_dim!r}")
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"dnc: num_iters must be a positive int, got {num_iters!r}")
    if not filter_frac >= 0.0:
        raise ValueError(f"dnc: filter_frac must be >= 0, got {filter_frac}")
    removed = int(filter_frac * f)

    def update(stacked, state, params=None, *, mask=None, key=None, **extra):
        del state, extra
        key = require_key("dnc", key)
        n = check_stacked(stacked, params)
        check_count("dnc", honest_majority, f, n)
        sq = tree.sq_norms(stacked, params)
        valid = allowed(mask, n) & jnp.isfinite(sq)
        m = static_count(valid)
        check_count("dnc", honest_majority, f, m)
        total = sum(math.prod(x.shape[1:]) for x in jax.tree_util.tree_leaves(stacked))
        good = valid
        for k in jax.random.split(key, num_iters):
            cols = columns(stacked, params, sample_coordinates(k, total, subsample_dim))
            good = good & ~dnc_outliers(cols, valid, removed)
        w = uniform_over(good)
        merged = views.combine(stacked, w, params) if params is not None else views.weighted_sum(stacked, w)
        bad = None if m is not None else too_few(honest_majority, f, valid)
        return nan_if(bad, merged), RuleState(AggregationInfo(valid, good, w, True))

    return Aggregator(init_rule_state, update, "dnc")
