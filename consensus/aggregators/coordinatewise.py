"""Coordinate-wise robust rules: median and trimmed mean, by sorting networks.

Each coordinate is aggregated on its own. The kernels (kernels.sorting) stream
the stack once; rules over a (16, 1e7) stack cost about one pass over memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    all_finite,
    allowed,
    check_count,
    check_f,
    check_stacked,
    coordinatewise,
    init_rule_state,
    static_count,
    under_outer_jit,
    uniform_over,
    unless_non_finite,
    valid_nodes,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, at_least, honest_majority
from kernels import sorting


def optimistic_pass(kernel, stacked, mask, n: int, **kwargs):
    """Run a coordinate-wise rule in one pass on every allowed node, then check the result.

    With ``poison`` the kernels turn any NaN/Inf of a kept row into NaN at that
    coordinate of the output, so a finite output proves every allowed node was
    finite and the separate finiteness pass is not needed. Returns
    (merged, valid) or None (non-finite output eagerly, or a view whose
    validity is already known).

    Under an outer jit the same check runs inside the program: when every node
    is allowed, the static-count kernel (every order position a Python int, as
    eagerly) runs first and :func:`unless_non_finite` on its output falls
    back to the finiteness pass and the traced-count kernel only when it is
    not finite. With a traced mask, a first ``lax.cond`` on "every node allowed"
    chooses between the two.

    Args:
      kernel: A coordinate-wise kernel of :mod:`kernels.sorting`.
      stacked: The stacked tree (or a lazy view).
      mask: Optional (n,) bool vector of the nodes allowed to take part.
      n: The number of nodes.
      **kwargs: Passed on to the kernel (e.g. ``f``).

    Returns:
      ``(merged, valid)``, or None when the one-pass route does not apply.
    """
    if views.is_view(stacked) and (stacked.valid is not None or stacked.mixing is not None):
        return None
    valid = allowed(mask, n)
    if not under_outer_jit(stacked, mask):
        keep, m = keep_args(valid, n)
        merged = coordinatewise(kernel, stacked, keep=keep, m=m, poison=True, **kwargs)
        if bool(all_finite(merged)):
            return merged, valid
        return None

    def over_finite_nodes():
        ok = valid_nodes(stacked, mask)
        return coordinatewise(kernel, stacked, keep=ok, **kwargs), ok

    def every_node():
        merged = coordinatewise(kernel, stacked, keep=None, m=None, poison=True, **kwargs)
        return unless_non_finite((merged, valid), over_finite_nodes)

    if mask is None:
        return every_node()
    return jax.lax.cond(jnp.all(valid), every_node, over_finite_nodes)


def keep_args(valid: jax.Array, n: int):
    """Return ``(keep, m)`` for the kernels: no mask at all when every node is valid.

    Args:
      valid: (n,) bool, the valid nodes.
      n: The number of nodes.

    Returns:
      ``(None, None)`` when all n are valid (statically), else ``(valid, m)`` with m the static
      count (None when traced).
    """
    m = static_count(valid)
    if m == n:
        return None, None
    return valid, m


@RULES.declare(kind="coordinatewise", precondition=at_least(1), elementwise=True, reads_views=True)
def median() -> Aggregator:
    r"""Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning").

    .. math:: y_k = \mathrm{median}\{x_{i,k} : i \in V\}

    With an even number m of valid nodes, the mean of the two middle values.
    Tolerates f < m/2 Byzantine nodes per coordinate (breakdown point 1/2).
    Precondition: m >= 1. ``info.linear`` is False; ``info.weights`` is the
    uniform share over valid nodes. ``update`` also takes ``assume_finite=True`` to skip the
    finiteness check.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Yin, Chen, Ramchandran and Bartlett 2018, ICML, "Byzantine-Robust Distributed
      Learning: Towards Optimal Statistical Rates".
    """

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        fast = None if assume_finite else optimistic_pass(sorting.median, stacked, mask, n)
        if fast is not None and static_count(fast[1]) != 0:
            merged, valid = fast
            return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))
        valid = valid_nodes(stacked, mask, assume_finite)
        check_count("median", at_least(1), 0, static_count(valid))
        keep, m = keep_args(valid, n)
        merged = coordinatewise(sorting.median, stacked, keep=keep, m=m)
        return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))

    return Aggregator(init_rule_state, update, "median")


@RULES.declare(
    kind="coordinatewise", takes_f=True, precondition=honest_majority, elementwise=True, reads_views=True
)
def trimmed_mean(num_byzantine: int) -> Aggregator:
    r"""Coordinate-wise trimmed mean (Yin et al. 2018), f removed from *each* side.

    .. math:: y_k = \frac{1}{m - 2f} \sum_{r=f}^{m-f-1} x_{(r),k}

    where x_(r),k is the r-th smallest of the m valid values at coordinate k: f values
    are trimmed per side (2f in all), m - 2f kept.
    Precondition: m > 2f (ValueError otherwise; NaN output under an outer jit).

    Args:
      num_byzantine: f, the number of values removed from each side at every coordinate.

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.linear`` is False.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold (a ValueError).

    References:
      Yin, Chen, Ramchandran and Bartlett 2018, ICML, "Byzantine-Robust Distributed
      Learning: Towards Optimal Statistical Rates".
    """
    f = check_f("trimmed_mean", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("trimmed_mean", honest_majority, f, n)
        fast = None if assume_finite else optimistic_pass(sorting.trimmed_mean, stacked, mask, n, f=f)
        m_fast = None if fast is None else static_count(fast[1])
        if fast is not None and (m_fast is None or honest_majority(m_fast, f) is None):
            merged, valid = fast
            return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))
        valid = valid_nodes(stacked, mask, assume_finite)
        check_count("trimmed_mean", honest_majority, f, static_count(valid))
        keep, m = keep_args(valid, n)
        merged = coordinatewise(sorting.trimmed_mean, stacked, f=f, keep=keep, m=m)
        return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))

    return Aggregator(init_rule_state, update, "trimmed_mean")
