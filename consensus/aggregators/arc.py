"""ARC, adaptive robust clipping: a pre-aggregator that clips the largest deltas to the next norm.

References:
  Allouah, Guerraoui, Gupta, Jellouli, Rizk and Stephan 2024, "Boosting Robustness by
  Clipping Gradients in Distributed Learning".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus.aggregators._common import (
    check_f,
)
from consensus.aggregators.pre import ClipState, norm_scaling_update
from consensus.base import PreAggregator
from consensus.specs import RULES, honest_majority


def arc_scales(sq_norms: jax.Array, valid: jax.Array, f: int) -> jax.Array:
    """Return ARC's (n,) clip factors: the floor(2 f (m - f) / m) largest deltas clipped to the next norm.

    Args:
      sq_norms: (n,) squared norms of the node deltas.
      valid: (n,) bool, the valid nodes (m of them).
      f: The number of Byzantine nodes.

    Returns:
      (n,) float factors: ``threshold / norm`` for the clipped nodes, 1 for the others, 0 for
      invalid nodes.
    """
    norms = jnp.sqrt(jnp.maximum(jnp.where(valid, sq_norms, 0.0), 0.0))
    m = jnp.sum(valid.astype(jnp.int32))
    k = (2 * f * (m - f)) // jnp.maximum(m, 1)
    # Descending order of the valid norms; invalid nodes sort last.
    desc = -jnp.sort(-jnp.where(valid, norms, -jnp.inf))
    threshold = desc[jnp.clip(k, 0, norms.shape[0] - 1)]
    scale = jnp.where(norms > threshold, threshold / jnp.maximum(norms, 1e-30), 1.0)
    return jnp.where(valid, scale, 0.0)


@RULES.declare(
    kind="pre",
    takes_f=True,
    precondition=honest_majority,
    sensitivity="not bounded by a fixed C (the clip threshold is the data's (k+1)-th largest norm)",
)
def arc(num_byzantine: int) -> PreAggregator:
    r"""Adaptive robust clipping (ARC, Allouah et al. 2024), a pre-aggregator.

    With node deltas d_i = x_i - c (c = ``params``, or 0 when params is None,
    as for :func:`~consensus.aggregators.pre.clip`) and m valid nodes, the
    k = floor(2 f (m - f) / m) deltas of largest norm are clipped to the norm
    of the (k+1)-th largest; the others are unchanged:

    .. math:: x_i' = c + d_i \min(1, \lVert d_{(k+1)} \rVert / \lVert d_i \rVert)

    The threshold adapts to the round (no clip radius to tune); ties in norm
    clip to the same value. Non-finite or masked-out nodes come out as NaN.
    Precondition: m > 2f (the paper's f < n/2). One norm pass (none inside a
    pipeline that already has a Gram matrix); lazy inside ``process``.
    DP sensitivity: not bounded by a fixed C (the threshold is data-dependent).

    Args:
      num_byzantine: f, the number of Byzantine nodes; sets how many deltas are clipped.

    Returns:
      A :class:`~consensus.base.PreAggregator` (n -> n) whose state is a
      :class:`~consensus.aggregators.pre.ClipState`.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold.

    References:
      Allouah, Guerraoui, Gupta, Jellouli, Rizk and Stephan 2024, "Boosting Robustness by
      Clipping Gradients in Distributed Learning".
    """
    f = check_f("arc", num_byzantine)

    def init(params):
        del params
        return ClipState(jnp.zeros((0,), jnp.float32))

    update = norm_scaling_update("arc", lambda sq, valid: arc_scales(sq, valid, f), honest_majority, f)

    return PreAggregator(init, update, "arc")
