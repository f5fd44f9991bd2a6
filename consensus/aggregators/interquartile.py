"""The interquartile mean: the coordinate-wise mean of the middle half of the valid values."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_stacked,
    init_rule_state,
    nan_if,
    static_count,
    too_few,
    uniform_over,
    valid_nodes,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, need


def iqm_precondition(n: int, f: int) -> str | None:
    """Check the interquartile mean's precondition: n >= max(1, 4f).

    At least one valid node, and f within the quarter that each side trims.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return need(n >= max(1, 4 * f), f"n >= max(1, 4f) = {max(1, 4 * f)}")


def _iqm_leaf(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean over the ranks [m // 4, m - m // 4) of the valid values, coordinate by coordinate."""
    n = x.shape[0]
    rows = jnp.where(valid.reshape((n,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), jnp.inf)
    ordered = jnp.sort(rows, axis=0)  # the m valid values first, the invalid (+inf) last
    m = jnp.sum(valid.astype(jnp.int32))
    lo = m // 4
    ranks = jnp.arange(n).reshape((n,) + (1,) * (x.ndim - 1))
    kept = (ranks >= lo) & (ranks < m - lo)
    total = jnp.sum(jnp.where(kept, ordered, 0.0), axis=0)
    # One scalar reciprocal, then a multiply: the same bits in every vector lane and slice width.
    inverse = 1.0 / jnp.maximum(m - 2 * lo, 1).astype(jnp.float32)
    return (total * inverse).astype(x.dtype)


@RULES.declare(kind="coordinatewise", precondition=iqm_precondition, elementwise=True)
def interquartile_mean() -> Aggregator:
    r"""Interquartile mean: at every coordinate, the mean of the middle half of the valid values.

    .. math:: y_k = \frac{1}{m - 2q} \sum_{r=q}^{m-q-1} x_{(r),k}, \quad q = \lfloor m / 4 \rfloor

    where x_(r),k is the r-th smallest of the m valid values at coordinate k: a trimmed
    mean whose trim per side, q, follows the valid count instead of a given f. It
    tolerates f <= m / 4 Byzantine nodes, the precondition (n >= 4f) that configs check
    against their f; the rule itself is not told f. Precondition at run time: m >= 1
    (ByzantineToleranceError eagerly; NaN output under an outer jit). ``info.linear`` is
    False; ``info.weights`` is the uniform share over the valid nodes.

    Returns:
      An :class:`~consensus.base.Aggregator`.

    Raises:
      ByzantineToleranceError: From ``update``, when no node is valid.
    """

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        check_stacked(stacked, params)
        valid = valid_nodes(stacked, mask)
        m = static_count(valid)
        check_count("interquartile_mean", iqm_precondition, 0, m)
        merged = jax.tree.map(lambda x: _iqm_leaf(x, valid), stacked)
        bad = None if m is not None else too_few(iqm_precondition, 0, valid)
        info = AggregationInfo(valid, valid, uniform_over(valid), False)
        return nan_if(bad, merged), RuleState(info)

    return Aggregator(init_rule_state, update, "interquartile_mean")
