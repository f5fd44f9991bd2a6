"""The Krum family: Krum, Multi-Krum and Bulyan.

All three start from one Gram pass over the (centred) stack: the n x n squared
distances are all that selection needs. Krum and Multi-Krum finish with one
weighted-sum pass; Bulyan with one sorting-network pass over the selected rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_f,
    check_stacked,
    coordinatewise,
    gram_stats,
    init_rule_state,
    nan_if,
    static_count,
    too_few,
    uniform_over,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, need
from kernels import krum as krum_kernels
from kernels import sorting


def krum_precondition(n: int, f: int) -> str | None:
    """Check Krum's and Multi-Krum's precondition (Blanchard et al. 2017): n > 2f + 2.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return need(n > 2 * f + 2, f"n > 2f + 2 = {2 * f + 2}")


def bulyan_precondition(n: int, f: int) -> str | None:
    """Check Bulyan's precondition: n >= 4f + 3.

    theta = m - 2f selected nodes leave beta = theta - 2f >= 3 values per coordinate.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return need(n >= 4 * f + 3, f"n >= 4f + 3 = {4 * f + 3}")


@RULES.declare(kind="vector", takes_f=True, precondition=krum_precondition, reads_views=True)
def krum(num_byzantine: int) -> Aggregator:
    """Krum (Blanchard et al. 2017, NeurIPS, "Machine Learning with Adversaries").

    Node i's score is the *sum* of squared distances to its k = m - f - 2
    nearest valid neighbours (itself excluded); the output is the valid node
    with the lowest score (the lowest index on ties). Distances come from a
    Gram matrix centred on ``params`` (pass the current global params) or, if
    None, on the mean of the nodes (formed in the same pass, see
    ``_common.gram_stats``), so they stay accurate when the nodes are close
    together.

    Precondition: m > 2f + 2 valid nodes (ValueError naming n, f otherwise;
    NaN output under an outer jit).

    Args:
      num_byzantine: f, the number of Byzantine nodes; each score sums over the
        k = m - f - 2 nearest neighbours.

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.selected`` is the winner (one-hot).

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f + 2 does not hold (a ValueError).

    References:
      Blanchard, El Mhamdi, Guerraoui and Stainer 2017, NeurIPS, "Machine Learning with
      Adversaries: Byzantine Tolerant Gradient Descent".
    """
    f = check_f("krum", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("krum", krum_precondition, f, n)
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        check_count("krum", krum_precondition, f, m)
        chosen = krum_kernels.krum_select(stats.sq_dists, f, stats.valid)
        w = chosen.astype(jnp.float32)
        if views.is_view(stacked) and stacked.mixing is not None:
            merged = views.weighted_sum(stacked, w)
        else:
            # The winner's row itself: reads 1/n of the stack, where a one-hot
            # weighted sum would read all of it.
            winner = jnp.argmax(chosen)
            merged = jax.tree.map(lambda x: x[winner], views.base_of(stacked))
        bad = None if m is not None else too_few(krum_precondition, f, stats.valid)
        return nan_if(bad, merged), RuleState(AggregationInfo(stats.valid, chosen, w, True))

    return Aggregator(init_rule_state, update, "krum")


@RULES.declare(kind="vector", takes_f=True, precondition=krum_precondition, reads_views=True)
def multi_krum(num_byzantine: int, num_selected: int | None = None) -> Aggregator:
    """Multi-Krum (Blanchard et al. 2017): the mean of the ``num_selected`` best-scored nodes.

    Scores as in :func:`krum` (sum over the m - f - 2 nearest), computed once on
    all valid nodes. ``num_selected`` defaults to m - f.

    Preconditions: m > 2f + 2 and 1 <= num_selected <= m - f.

    Args:
      num_byzantine: f, the number of Byzantine nodes (scores sum over the m - f - 2 nearest).
      num_selected: How many best-scored nodes to average; None for m - f.

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.selected`` is the selection.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int or ``num_selected`` not a
        positive int; from ``update`` under jit when ``num_selected`` is None.
      ByzantineToleranceError: From ``update``, when m > 2f + 2 or num_selected <= m - f
        does not hold.

    References:
      Blanchard, El Mhamdi, Guerraoui and Stainer 2017, NeurIPS, "Machine Learning with
      Adversaries: Byzantine Tolerant Gradient Descent".
    """
    f = check_f("multi_krum", num_byzantine)
    if num_selected is not None and (not isinstance(num_selected, int) or num_selected < 1):
        raise ValueError(f"multi_krum: num_selected must be a positive int, got {num_selected!r}")

    def selects(n: int, f: int) -> str | None:
        """Krum's precondition and, with ``num_selected`` given, room for it: num_selected <= n - f."""
        if num_selected is None:
            return krum_precondition(n, f)
        return krum_precondition(n, f) or need(
            num_selected <= n - f, f"num_selected = {num_selected} <= n - f"
        )

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("multi_krum", selects, f, n)
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        check_count("multi_krum", selects, f, m)
        if num_selected is None:
            if m is None:
                raise ValueError("multi_krum: give num_selected explicitly when the update runs under jit")
            k = m - f
        else:
            k = num_selected
        chosen = krum_kernels.multi_krum_select(stats.sq_dists, f, stats.valid, k)
        w = uniform_over(chosen)
        merged = views.weighted_sum(stacked, w)
        bad = None if m is not None else too_few(selects, f, stats.valid)
        return nan_if(bad, merged), RuleState(AggregationInfo(stats.valid, chosen, w, True))

    return Aggregator(init_rule_state, update, "multi_krum")


@RULES.declare(
    kind="vector",
    takes_f=True,
    precondition=bulyan_precondition,
    reads_views=True,
    # its coordinate-wise second stage is no weighted combination of the inputs (``info.linear``)
    traits={"linear": False},
)
def bulyan(num_byzantine: int) -> Aggregator:
    """Bulyan (El Mhamdi, Guerraoui and Rouault 2018, ICML, "The Hidden Vulnerability ...").

    1. Selection by *iterated* Krum: theta = m - 2f nodes, each chosen by Krum on
       the nodes not chosen yet (scores recomputed every time, sum over the
       m_remaining - f - 2 nearest, floored at 1 neighbour). This is the paper's
       recursion; Flower's newer version selects in one shot instead.
    2. Coordinate-wise: at every coordinate the mean of the beta = theta - 2f
       selected values closest to their median.

    Precondition: m >= 4f + 3 (ValueError naming n, f otherwise). ``info.selected``
    is the theta-set; ``info.linear`` is False.

    Cost: one Gram pass; the selection sorts each distance row once and then
    takes O(n^2) per round (:func:`kernels.krum.iterated_picks`); the second
    stage is one sorting-network pass over the masked stack up to theta = 16
    rows and, above, an exact bisection selection over a gathered copy of the
    theta chosen rows (theta / n of the stack in extra memory).

    Args:
      num_byzantine: f, the number of Byzantine nodes.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m >= 4f + 3 does not hold (a ValueError).

    References:
      El Mhamdi, Guerraoui and Rouault 2018, ICML, "The Hidden Vulnerability of Distributed
      Learning in Byzantium".
    """
    f = check_f("bulyan", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("bulyan", bulyan_precondition, f, n)
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        check_count("bulyan", bulyan_precondition, f, m)

        def with_count(count: int):
            """Both stages with m = count valid nodes known statically (theta = m - 2f)."""
            theta = count - 2 * f
            chosen = krum_kernels.iterated_krum_select(stats.sq_dists, f, stats.valid, theta)
            if theta > sorting.WINDOW_NETWORK_MAX and not views.is_view(stacked):
                # Selection's cost grows with the rows it reads: gather the theta chosen rows
                # (one copy of theta/n of the stack) rather than read all n with n - theta
                # excluded (benchmarks/speed/robust_speed.py). Below, the sorting network
                # prefers the mask.
                idx = jnp.flatnonzero(chosen, size=theta)
                rows = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), stacked)
                merged = coordinatewise(sorting.closest_to_median_mean, rows, f=f, m=theta)
            else:
                merged = coordinatewise(sorting.closest_to_median_mean, stacked, f=f, keep=chosen, m=theta)
            return merged, chosen

        def traced_count():
            # Under an outer jit the count is traced: select n - 2f and drop the
            # surplus picks (the last ones chosen) beyond theta.
            theta = jnp.sum(stats.valid) - 2 * f
            chosen = _iterated_prefix(stats.sq_dists, f, stats.valid, n - 2 * f, theta)
            merged = coordinatewise(sorting.closest_to_median_mean, stacked, f=f, keep=chosen)
            # Too few valid nodes: NaN. Applied here, not after the cond: a select over the
            # cond's output would be one more output-sized pass on the fast path too.
            return nan_if(too_few(bulyan_precondition, f, stats.valid), merged), chosen

        if m is not None:
            merged, chosen = with_count(m)
        else:
            # Every node valid (the common case) takes the static-count kernels, with every order
            # position a Python int; the traced path only runs when some node is invalid.
            # With all n valid the precondition is n >= 4f + 3, checked above.
            merged, chosen = jax.lax.cond(jnp.all(stats.valid), lambda: with_count(n), traced_count)
        info = AggregationInfo(stats.valid, chosen, uniform_over(chosen), False)
        return merged, RuleState(info)

    return Aggregator(init_rule_state, update, "bulyan")


def _iterated_prefix(d2, f, valid, max_selected, theta):
    return krum_kernels.iterated_picks(d2, f, valid, max_selected, limit=theta)
