"""Spectral filters in Gram space: CAF and SMEA.

Both look at the top eigenvalue of the nodes' empirical covariance. With
deltas D (rows d_i = x_i - c, Gram matrix G = D D^T) and weights w summing to
1, the rows centred on their weighted mean are Y = (I - 1 w^T) D, so
Y Y^T = P G P^T with P = I - 1 w^T, and the non-zero eigenvalues of the
weighted covariance Y^T diag(w) Y are those of the n x n matrix
diag(w)^(1/2) P G P^T diag(w)^(1/2). Neither rule reads the parameters
beyond one Gram pass and one weighted-sum pass.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_f,
    check_stacked,
    gram_stats,
    init_rule_state,
    nan_if,
    static_count,
    too_few,
    top_eigenpair,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, honest_majority, need
from kernels.compile_options import kernel_jit

# SMEA enumerates C(n, f) subsets; above this many the rule refuses (memory ~ C(n, f) n^2 floats).
SMEA_MAX_SUBSETS = 20_000


def _centred_gram(g: jax.Array, w: jax.Array) -> jax.Array:
    """P G P^T with P = I - 1 w^T: the Gram matrix of the rows centred on sum_i w_i d_i."""
    gw = g @ w
    return g - gw[:, None] - gw[None, :] + w @ gw


@kernel_jit
def caf_weights(g: jax.Array, valid: jax.Array, f: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compute CAF's final weights and the smallest top eigenvalue seen, from the Gram matrix.

    Args:
      g: (n, n) Gram matrix of the node deltas.
      valid: (n,) bool, the valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      ``(weights, lam)``: (n,) weights summing to 1 and the scalar top eigenvalue at them.
    """
    n = g.shape[0]
    c0 = valid.astype(jnp.float32)
    m = jnp.sum(c0)
    stop_at = m - 2.0 * jnp.asarray(f, jnp.float32)

    def body(_, carry):
        c, best_lam, best_w, done = carry
        s = jnp.sum(c)
        active = (~done) & (s > stop_at)
        w = c / jnp.maximum(s, 1e-30)
        h = _centred_gram(g, w)
        root = jnp.sqrt(w)
        lam, u = top_eigenpair(root[:, None] * h * root[None, :])
        lam = jnp.maximum(lam, 0.0)
        # Projections of every centred row on the top eigenvector of the weighted covariance.
        proj = h @ (root * u) / jnp.sqrt(jnp.maximum(lam, 1e-30))
        tau = jnp.where(lam > 0, jnp.square(proj), 0.0)
        better = active & (lam < best_lam)
        best_lam = jnp.where(better, lam, best_lam)
        best_w = jnp.where(better, w, best_w)
        tau_max = jnp.max(jnp.where(c > 0, tau, 0.0))
        c_new = jnp.where(tau_max > 0, c * (1.0 - tau / jnp.maximum(tau_max, 1e-30)), c)
        # The node(s) at the maximum leave exactly (1 - tau / tau_max rounds differently under jit).
        c_new = jnp.where((c > 0) & (tau >= tau_max), 0.0, jnp.maximum(c_new, 0.0))
        done = done | (active & (tau_max <= 0)) | ~active
        return jnp.where(active, c_new, c), best_lam, best_w, done

    init = (c0, jnp.float32(jnp.inf), c0 / jnp.maximum(m, 1.0), jnp.bool_(False))
    _, best_lam, best_w, _ = jax.lax.fori_loop(0, n + 1, body, init)
    return best_w, best_lam


@RULES.declare(kind="vector", takes_f=True, precondition=honest_majority, reads_views=True)
def caf(num_byzantine: int) -> Aggregator:
    """Covariance-bound agnostic filter (CAF; Allouah et al. 2025): shrink the weights of outliers.

    ByzFL's ``CAF``.

    Start from weights c_i = 1 on the m valid nodes. While sum_i c_i > m - 2f:
    take the weighted mean mu_c = sum c_i x_i / sum c_i, the top eigenpair
    (lambda, v) of the weighted covariance sum_i c_i (x_i - mu_c)(x_i - mu_c)^T / sum c_i,
    the scores tau_i = <x_i - mu_c, v>^2, and shrink c_i <- c_i (1 - tau_i / max_{c_j > 0} tau_j).
    The output is the mu_c with the smallest lambda seen. Differences from
    ByzFL: the eigenpair is exact (eigh in n x n Gram space, not one power
    iteration from a random vector), and the maximum of tau is over the nodes
    still weighted (so every step removes at least one node and the loop ends
    after at most m steps). ``info.weights`` = c / sum c at the chosen step.
    Precondition: m > 2f. DP sensitivity: 2C (output in the C-ball).

    Args:
      num_byzantine: f; the loop runs while the total weight exceeds m - 2f.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold.

    References:
      Allouah, Guerraoui and Stephan 2025, ICML, "Towards Trustworthy Federated Learning
      with Untrusted Participants".
    """
    f = check_f("caf", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("caf", honest_majority, f, n)
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        check_count("caf", honest_majority, f, m)
        w, _ = caf_weights(stats.gram, stats.valid, f)
        merged = views.combine(stacked, w, stats.centre)
        bad = None if m is not None else too_few(honest_majority, f, stats.valid)
        return nan_if(bad, merged), RuleState(AggregationInfo(stats.valid, w > 0, w, True))

    return Aggregator(init_rule_state, update, "caf")


def smea_drop_sets(n: int, f: int) -> np.ndarray:
    """Enumerate every set of f nodes to drop, in ``itertools.combinations`` order.

    Args:
      n: The number of nodes.
      f: The size of each dropped set.

    Returns:
      (C(n, f), n) bool array; row r marks the r-th set.
    """
    sets = np.zeros((math.comb(n, f), n), bool)
    for row, drop in enumerate(itertools.combinations(range(n), f)):
        sets[row, list(drop)] = True
    return sets


@kernel_jit
def smea_choice(g: jax.Array, valid: jax.Array, drops: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Find the size m - f subset with the smallest top eigenvalue of its covariance.

    Args:
      g: (n, n) Gram matrix of the node deltas.
      valid: (n,) bool, the valid nodes.
      drops: (C(n, f), n) bool, the candidate dropped sets (:func:`smea_drop_sets`).

    Returns:
      ``(keep, lam)``: the kept nodes (n,) bool and their top eigenvalue.
    """
    ok = ~jnp.any(drops & ~valid[None, :], axis=1)
    keep = valid[None, :] & ~drops
    k = jnp.maximum(jnp.sum(keep.astype(jnp.float32), axis=1), 1.0)
    w = keep.astype(jnp.float32) / k[:, None]

    def top(wi, ki):
        h = _centred_gram(g, wi)
        both = (wi > 0)[:, None] & (wi > 0)[None, :]
        return jnp.linalg.eigvalsh(jnp.where(both, h, 0.0) / ki)[-1]

    lam = jnp.where(ok, jax.vmap(top)(w, k), jnp.inf)
    best = jnp.argmin(lam)
    return keep[best], lam[best]


def smea_precondition(n: int, f: int) -> str | None:
    """Check SMEA's precondition: an honest majority, and few enough subsets to enumerate.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when n > 2f and C(n, f) <= 20000, else the requirement in words.
    """
    subsets = math.comb(n, f)
    return honest_majority(n, f) or need(
        subsets <= SMEA_MAX_SUBSETS, f"C(n, f) = {subsets} <= {SMEA_MAX_SUBSETS} subsets"
    )


@RULES.declare(
    kind="vector",
    takes_f=True,
    precondition=smea_precondition,
    formula=f"n > 2f and C(n, f) <= {SMEA_MAX_SUBSETS}",
    reads_views=True,
)
def smea(num_byzantine: int) -> Aggregator:
    """Smallest maximum eigenvalue averaging (SMEA; Allouah et al. 2023): the least spread subset's mean.

    Over every subset S of m - f valid nodes, the top eigenvalue of the
    empirical covariance ``(1/|S|) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T``; the
    output is the mean of the subset with the smallest one (the first in
    ``itertools.combinations`` order of the dropped nodes on ties). Exact, by
    enumeration: C(n, f) eigenvalue problems of size n x n on the Gram matrix.
    Precondition: m > 2f and C(n, f) <= 20000 (ValueError otherwise).
    DP sensitivity: 2C (output in the C-ball around the last consensus).

    Args:
      num_byzantine: f; subsets of m - f valid nodes are compared.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f or C(n, f) <= 20000 does not hold.

    References:
      Allouah, Guerraoui, Gupta, Pinot and Stephan 2023, ICML, "On the
      Privacy-Robustness-Utility Trilemma in Distributed Learning".
    """
    f = check_f("smea", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("smea", smea_precondition, f, n)
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        check_count("smea", smea_precondition, f, m)
        keep, _ = smea_choice(stats.gram, stats.valid, jnp.asarray(smea_drop_sets(n, f)))
        w = keep.astype(jnp.float32) / jnp.maximum(jnp.sum(keep.astype(jnp.float32)), 1.0)
        merged = views.combine(stacked, w, stats.centre)
        bad = None if m is not None else too_few(smea_precondition, f, stats.valid)
        return nan_if(bad, merged), RuleState(AggregationInfo(stats.valid, keep, w, True))

    return Aggregator(init_rule_state, update, "smea")
