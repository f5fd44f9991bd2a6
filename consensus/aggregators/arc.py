"""ARC, adaptive robust clipping (Allouah, Guerraoui, Gupta, Jellouli, Rizk and Stephan 2024,
"Boosting Robustness by Clipping Gradients in Distributed Learning")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators import view as views
from consensus.aggregators._common import (
    allowed,
    check_count,
    check_f,
    check_stacked,
    gram_stats,
    static_count,
)
from consensus.aggregators.pre import ClipState
from consensus.base import PreAggregator
from consensus.specs import RULES, honest_majority


def arc_scales(sq_norms: jax.Array, valid: jax.Array, f: int) -> jax.Array:
    """(n,) ARC clip factors: the floor(2 f (m - f) / m) largest valid deltas clipped to the next norm."""
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
    """Adaptive robust clipping (ARC, Allouah et al. 2024), a pre-aggregator.

    With node deltas d_i = x_i - c (c = ``params``, or 0 when params is None,
    as for :func:`~consensus.aggregators.pre.clip`) and m valid nodes, the
    k = floor(2 f (m - f) / m) deltas of largest norm are clipped to the norm
    of the (k+1)-th largest; the others are unchanged:

    .. math:: x_i' = c + d_i \\min(1, \\lVert d_{(k+1)} \\rVert / \\lVert d_i \\rVert)

    The threshold adapts to the round (no clip radius to tune); ties in norm
    clip to the same value. Non-finite or masked-out nodes come out as NaN.
    Precondition: m > 2f (the paper's f < n/2). One norm pass (none inside a
    pipeline that already has a Gram matrix); lazy inside ``process``.
    DP sensitivity: not bounded by a fixed C (the threshold is data-dependent).
    """
    f = check_f("arc", num_byzantine)

    def init(params):
        del params
        return ClipState(jnp.zeros((0,), jnp.float32))

    def update(stacked, state, params=None, *, mask=None, lazy=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("arc", honest_majority, f, n)
        v = views.with_norms(stacked) if views.is_view(stacked) else views.identity(stacked, params)
        if v.gram is not None:
            sq, valid = jnp.diagonal(v.gram), v.valid
        elif v.mixing is None:
            sq = tree.sq_norms(v.base, v.centre)
            valid = jnp.isfinite(sq) if v.valid is None else jnp.isfinite(sq) & v.valid
        else:
            stats = gram_stats(v, params, None)
            sq, valid = jnp.diagonal(stats.gram), stats.valid
        valid = valid & allowed(mask, n)
        check_count("arc", honest_majority, f, static_count(valid))
        scale = arc_scales(sq, valid, f)
        gram = None if v.gram is None else v.gram * scale[:, None] * scale[None, :]
        out = views.compose(v, jnp.diag(scale), diagonal=True, gram=gram, valid=valid)
        return (out if lazy else views.materialize(out)), ClipState(scale)

    return PreAggregator(init, update, "arc")
