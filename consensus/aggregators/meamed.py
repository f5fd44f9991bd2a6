"""Meamed, the coordinate-wise mean around the median.

References:
  Xie, Koyejo and Gupta 2018, "Generalized Byzantine-tolerant SGD".
"""

from __future__ import annotations

from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_f,
    check_stacked,
    coordinatewise,
    init_rule_state,
    nan_if,
    static_count,
    too_few,
    uniform_over,
    valid_nodes,
)
from consensus.aggregators.coordinatewise import keep_args, optimistic_pass
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, honest_majority
from kernels import robust as robust_kernels
from kernels.sorting import WINDOW_NETWORK_MAX


@RULES.declare(
    kind="coordinatewise", takes_f=True, precondition=honest_majority, elementwise=True, reads_views=True
)
def meamed(num_byzantine: int) -> Aggregator:
    r"""Mean around the median (Meamed, Xie et al. 2018), coordinate-wise.

    .. math:: y_k = \frac{1}{m - f} \sum_{i \in N_k} x_{i,k}

    where N_k holds the m - f valid values at coordinate k nearest to their
    median (ties: the window of sorted values whose farther end is nearest the
    median, the lowest one first). Unlike the trimmed mean, which drops f
    values from *each* side, Meamed drops f values in all, from whichever side
    is farther. Precondition: m > 2f (ValueError otherwise; NaN under an
    outer jit). Up to 16 rows one sorting-network pass in the common case (the
    kernel poisons the output with any NaN/Inf of a row, so a finite output
    proves every node finite, as the median's); otherwise, or when a node is
    not finite, a finiteness pass first. Above 16 rows: exact selection.
    DP sensitivity: as the coordinate-wise rules, 2C (any output in the
    C-ball around the last consensus). ``update`` also takes ``assume_finite=True``.

    Args:
      num_byzantine: f; the m - f values nearest the median are averaged (f dropped in all).

    Returns:
      An :class:`~consensus.base.Aggregator`; ``info.linear`` is False.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold (a ValueError).

    References:
      Xie, Koyejo and Gupta 2018, "Generalized Byzantine-tolerant SGD".
    """
    f = check_f("meamed", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("meamed", honest_majority, f, n)
        fast = None
        if not assume_finite and n <= WINDOW_NETWORK_MAX:
            fast = optimistic_pass(robust_kernels.meamed, stacked, mask, n, f=f)
        m_fast = None if fast is None else static_count(fast[1])
        if fast is not None and (m_fast is None or honest_majority(m_fast, f) is None):
            merged, valid = fast
            if m_fast is None:
                merged = nan_if(too_few(honest_majority, f, valid), merged)
            return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))
        valid = valid_nodes(stacked, mask, assume_finite)
        m = static_count(valid)
        check_count("meamed", honest_majority, f, m)
        keep, m_arg = keep_args(valid, n)
        merged = coordinatewise(robust_kernels.meamed, stacked, f=f, keep=keep, m=m_arg)
        if m is None:
            merged = nan_if(too_few(honest_majority, f, valid), merged)
        return merged, RuleState(AggregationInfo(valid, valid, uniform_over(valid), False))

    return Aggregator(init_rule_state, update, "meamed")
